"""Splits the dataset and writes it as TFRecord shards of serialized `tf.train.Example` protos, without TensorFlow.

The same input always gives byte-identical shards: examples keep their archive order inside a split,
shard k holds a contiguous slice, and training shuffles at read time.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numpy as np

from cifar.config import DataConfig
from cifar.data.archive import RawDataset
from cifar.data.manifest import IMAGE_BYTES, NUM_CLASSES, Shard, Split

logger = logging.getLogger("cifar.data")

SPLITS = ("train", "validation", "test")
MAX_WRITER_THREADS = 4  # File writes and hashlib release the GIL, so a few shards can be written at once.

ShardCallback = Callable[[int, int], None]  # (shards written so far, shards in all)


def _varint(value: int) -> bytes:
    """Protocol-buffer base-128 varint encoding of a non-negative integer."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _example_template() -> tuple[bytes, bytes]:
    """The constant bytes before the pixels and before the label byte of every serialized Example.

    Example{features=1: Features{feature=1: map entries {key=1, value=2: Feature}}}; the image is a
    BytesList (Feature field 1) of one 3,072-byte value, the label an Int64List (Feature field 3) of
    one packed varint, which is a single byte for labels 0..9.
    """
    marker = b"\x00" * IMAGE_BYTES
    image_entry = _field(1, b"image") + _field(2, _field(1, _field(1, marker)))
    label_entry = _field(1, b"label") + _field(2, _field(3, _field(1, b"\x00")))
    example = _field(1, _field(1, image_entry) + _field(1, label_entry))
    pixels_at = example.index(marker)
    # The label's varint is the very last byte of the serialized proto.
    return example[:pixels_at], example[pixels_at + IMAGE_BYTES : -1]


PREFIX, MIDDLE = _example_template()
RECORD_BYTES = len(PREFIX) + IMAGE_BYTES + len(MIDDLE) + 1  # 3,110 bytes per serialized Example.
CRC_MASK_DELTA = 0xA282EAD8  # TFRecord stores CRCs "masked" (rotated, plus this constant).


def masked_crc32c(data: bytes | np.ndarray) -> int:
    """The masked CRC32C TFRecord stores after the length and after the data."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + CRC_MASK_DELTA) & 0xFFFFFFFF


_LENGTH = struct.pack("<Q", RECORD_BYTES)
# Every record has the same length, so the 12-byte header (length, masked CRC of the length) is constant.
RECORD_HEADER = _LENGTH + struct.pack("<I", masked_crc32c(_LENGTH))
FRAMED_RECORD_BYTES = len(RECORD_HEADER) + RECORD_BYTES + 4  # 3,126 bytes per record in a shard file.


MAX_RECORD_BYTES = 1 << 16  # One 32x32 image's Example is 3,110 bytes; another writer's features fit many times.


def framing_problem(path: str | Path, max_record_bytes: int = MAX_RECORD_BYTES) -> str | None:
    """Why the TFRecord file at `path` is not safe to hand to TensorFlow, or None.

    Every record's length must carry its own checksum, fit in the file and be at most `max_record_bytes`:
    TensorFlow allocates what a header states before it reads (a 112-byte file stating a 1 TiB record
    crashes the process, one stating 2 GiB takes 800 MB). Reads the 12-byte headers only.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        position = index = 0
        while position < size:
            header = handle.read(len(RECORD_HEADER))
            where = f"record {index} (byte {position:,})"
            if len(header) < len(RECORD_HEADER):
                return f"{where}: the file ends inside its header"
            (length,), (checksum,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
            if checksum != masked_crc32c(header[:8]):
                return f"{where}: its length's checksum does not match (not a TFRecord file, or damaged)"
            if length > max_record_bytes:
                return f"{where} states {length:,} bytes, over the {max_record_bytes:,} bytes of a record of one image"
            position += len(RECORD_HEADER) + length + 4  # The header, the data, the data's checksum.
            if position > size:
                return f"{where} states {length:,} bytes, more than the file holds"
            handle.seek(position)
            index += 1
    return None


def encode_records(images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """TFRecord-framed serialized `tf.train.Example` protos, one row each: uint8 (N, FRAMED_RECORD_BYTES).

    Every example has the same two features, `image` (3,072 raw bytes) and `label` (int64 0..9), so every
    proto has the same length and the same bytes around the pixels and the label: rather than building
    60,000 `tf.train.Example` objects, a few vectorised copies fill each row with the record header
    (length and its CRC, constant), the proto and its masked CRC32C. The protos are byte-identical to
    `tf.train.Example(...).SerializeToString()` (features in sorted order) and a shard to what
    `tf.io.TFRecordWriter` writes (tests check both); a shard is one `write` and one SHA-256.
    """
    if images.dtype != np.uint8 or images.shape[1:] != (32, 32, 3):
        raise ValueError(f"images must be uint8 (N, 32, 32, 3), got {images.dtype} {images.shape}")
    if len(labels) != len(images):
        raise ValueError(f"{len(labels)} labels for {len(images)} images")
    if len(labels) and (labels.min() < 0 or labels.max() > 127):
        # Labels up to 127 fit the single varint byte the template reserves.
        raise ValueError(f"labels must be in 0..127 to encode, got {labels.min()}..{labels.max()}")
    framed = np.empty((len(images), FRAMED_RECORD_BYTES), dtype=np.uint8)
    image_start = len(RECORD_HEADER) + len(PREFIX)
    middle_start = image_start + IMAGE_BYTES
    framed[:, :image_start] = np.frombuffer(RECORD_HEADER + PREFIX, dtype=np.uint8)
    framed[:, image_start:middle_start] = images.reshape(len(images), IMAGE_BYTES)
    framed[:, middle_start:-5] = np.frombuffer(MIDDLE, dtype=np.uint8)
    framed[:, -5] = labels
    examples = framed[:, len(RECORD_HEADER) : -4]  # (N, RECORD_BYTES) view; each row is contiguous.
    crcs = np.fromiter((masked_crc32c(example) for example in examples), dtype="<u4", count=len(examples))
    framed[:, -4:] = crcs.view(np.uint8).reshape(-1, 4)
    return framed


def encode_examples(images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Serialized `tf.train.Example` protos without the TFRecord framing: uint8 (N, RECORD_BYTES)."""
    return encode_records(images, labels)[:, len(RECORD_HEADER) : -4]


def shard_bounds(num_examples: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges of near-equal size; never more shards than examples, none if empty."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    count = min(num_shards, num_examples)
    edges = [index * num_examples // count for index in range(count + 1)] if count else []
    return list(zip(edges[:-1], edges[1:]))


def shard_name(split: str, index: int, count: int) -> str:
    """File name of shard `index` of `count` in a split, e.g. train-00000-of-00008.tfrecord."""
    return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


def split_dataset(dataset: RawDataset, validation_size: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(images, labels) per split: train = first N - validation_size, validation = the rest, test.

    The official order is already random, so the last images validate. A split with no examples
    (validation_size 0) gets no shards.
    """
    if not 0 <= validation_size < len(dataset.train_images):
        raise ValueError(f"validation_size must be in 0..{len(dataset.train_images) - 1}, got {validation_size}")
    cut = len(dataset.train_images) - validation_size
    return {
        "train": (dataset.train_images[:cut], dataset.train_labels[:cut]),
        "validation": (dataset.train_images[cut:], dataset.train_labels[cut:]),
        "test": (dataset.test_images, dataset.test_labels),
    }


def class_counts(labels: np.ndarray) -> list[int]:
    """Examples per class id."""
    return [int(count) for count in np.bincount(labels, minlength=NUM_CLASSES)]


def write_shard(path: Path, records: np.ndarray) -> Shard:
    """Writes one TFRecord file of framed records (rows of `encode_records`) and returns its manifest entry."""
    records = np.ascontiguousarray(records)
    with open(path, "wb") as handle:
        handle.write(records.data)
    digest = hashlib.sha256(records.data).hexdigest()
    return Shard(path=path.name, sha256=digest, num_examples=len(records), num_bytes=records.nbytes)


def convert_dataset(
    dataset: RawDataset, config: DataConfig, output_dir: str | Path, on_shard: ShardCallback | None = None
) -> dict[str, Split]:
    """Splits the archive's dataset (`split_dataset`) and writes every split's shards (`convert_splits`)."""
    return convert_splits(split_dataset(dataset, config.validation_size), config, output_dir, on_shard)


def convert_splits(
    split_arrays: dict[str, tuple[np.ndarray, np.ndarray]],
    config: DataConfig,
    output_dir: str | Path,
    on_shard: ShardCallback | None = None,
) -> dict[str, Split]:
    """Writes every split's (images, labels) as shards into `output_dir` (a few at once); returns the splits."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    shard_counts = {"train": config.train_shards, "validation": config.validation_shards, "test": config.test_shards}
    jobs: list[tuple[str, Path, np.ndarray]] = []
    splits: dict[str, Split] = {}
    for split, (images, labels) in split_arrays.items():
        records = encode_records(images, labels)
        bounds = shard_bounds(len(records), shard_counts[split])
        for index, (start, stop) in enumerate(bounds):
            jobs.append((split, output_dir / shard_name(split, index, len(bounds)), records[start:stop]))
        splits[split] = Split(num_examples=len(labels), class_counts=class_counts(labels), shards=[])
    with ThreadPoolExecutor(max_workers=min(MAX_WRITER_THREADS, max(1, len(jobs)))) as executor:
        futures = [executor.submit(write_shard, path, records) for _, path, records in jobs]
        # Shards are listed in job order (split, then index), whatever order the threads finished in.
        for written, ((split, _, _), future) in enumerate(zip(jobs, futures), start=1):
            shard = future.result()
            logger.info("Wrote %s (%d examples, %.1f MB)", shard.path, shard.num_examples, shard.num_bytes / 1e6)
            splits[split].shards.append(shard)
            if on_shard is not None:
                on_shard(written, len(jobs))
    return splits
