"""What a source of images to score is, the files it covers, its digest, and its images in chunks.

Folders of PNG/JPEG files, CIFAR batch files, .npy arrays and TFRecord shards; the table of what each
reads and how a file that cannot be used is listed: docs/BATCH_INFERENCE.md ("Inputs").
"""

from __future__ import annotations

import glob
import hashlib
import os
import queue
import threading
import tokenize
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cifar.data.additions import (
    RESIZE_METHODS,
    FileProblem,
    NoUsableImagesError,
    decode_image,
    read_batch_rows,
    walk_files,
)
from cifar.data.drift import Profile, image_features
from cifar.data.manifest import IMAGE_BYTES, IMAGE_SHAPE
from cifar.io import CHUNK_BYTES

# Images read, scored and written at a time: enough to amortise each call's fixed cost (the signature call,
# a Parquet row group), few enough that a chunk in flight takes tens of MB (3 MB of pixels, 12 MB as floats).
CHUNK_IMAGES = 1000
TFRECORD_SUFFIX = ".tfrecord"
DIGEST_PREFIX = b"cifar-predict-input-v1\n"  # Versions the digest's definition, not the data.
GLOB_CHARACTERS = set("*?[")
# A batch file is a pickled dict: PROTO opens protocols 2-5 (CIFAR's batches are 2), MARK or EMPTY_DICT protocols 0-1.
PICKLE_STARTS = frozenset(b"\x80(}")
KIND_NAMES = {"folder": "image folder", "batch_file": "CIFAR batch file", "npy": ".npy array", "tfrecord": "TFRecords"}


@dataclass(frozen=True)
class ImageSource:
    """A source of images to score: its kind, its files (relative to `root`, sorted) and how to read them."""

    kind: str  # folder, batch_file, npy or tfrecord
    path: str  # As given, made absolute (a glob stays a pattern).
    root: Path  # Files are relative to it.
    files: tuple[str, ...]  # Every file the source covers, sorted: what its digest reads.
    not_regular: frozenset[str] = frozenset()  # Links and special files of a folder: listed, never read.
    resize: str | None = None


@dataclass
class Chunk:
    """Images read from a source, their names, and the files left out while reading them."""

    images: np.ndarray  # (n, 32, 32, 3) uint8
    names: list[str]  # Per image: its file (folder) or `<file>#<index>`.
    problems: list[FileProblem] = field(default_factory=list)
    consumed: int = 0  # Progress made: files of a folder, images otherwise.
    total: int | None = None  # What progress counts up to, once the reader knows.


def open_source(path: str | Path, *, resize: str | None = None) -> ImageSource:
    """What `path` is (folder, batch file, .npy, TFRecord shards) and its files; ValueError naming the problem.

    Only names, sizes and headers are read here: nothing is decoded or scored.
    """
    if resize is not None and resize not in RESIZE_METHODS:
        raise ValueError(f"resize must be one of {', '.join(RESIZE_METHODS)}, got {resize!r}")
    text = str(path)
    candidate = Path(text).expanduser()
    if not candidate.exists() and GLOB_CHARACTERS & set(text):
        source = _tfrecord_glob(candidate)
    elif candidate.is_dir():
        source = _directory(candidate.resolve())
    elif candidate.is_file():
        source = _single_file(candidate.resolve())
    else:
        raise ValueError(f"no file or folder at {text}")
    if resize is not None and source.kind != "folder":
        raise ValueError(
            f"resize applies to image folders; {source.path} is a {KIND_NAMES[source.kind]} (32x32 images)"
        )
    return ImageSource(**{**source.__dict__, "resize": resize})


def _tfrecord_glob(pattern: Path) -> ImageSource:
    shards = [Path(name).resolve() for name in glob.glob(str(pattern)) if name.endswith(TFRECORD_SUFFIX)]
    shards = [shard for shard in shards if shard.is_file()]
    if not shards:
        raise ValueError(f"no {TFRECORD_SUFFIX} files match {pattern}")
    root = Path(os.path.commonpath([str(shard.parent) for shard in shards]))
    files = tuple(sorted(str(shard.relative_to(root)) for shard in shards))
    return ImageSource(kind="tfrecord", path=str(Path.cwd() / pattern), root=root, files=files)


def _directory(path: Path) -> ImageSource:
    shards = sorted(
        entry.name
        for entry in os.scandir(path)
        if entry.name.endswith(TFRECORD_SUFFIX) and entry.is_file(follow_symlinks=False)
    )
    if shards:  # Our data directories hold shards (and manifest, statistics): the shards are the images.
        return ImageSource(kind="tfrecord", path=str(path), root=path, files=tuple(shards))
    entries = walk_files(path)
    if not entries:
        raise ValueError(f"{path} is an empty folder: expected PNG/JPEG files (or .tfrecord shards)")
    return ImageSource(
        kind="folder",
        path=str(path),
        root=path,
        files=tuple(relative for relative, _ in entries),
        not_regular=frozenset(relative for relative, entry in entries if entry is None),
    )


def _single_file(path: Path) -> ImageSource:
    if path.name.endswith(".npy"):
        npy_layout(path)  # Refuses another dtype or shape now, before any work.
        return ImageSource(kind="npy", path=str(path), root=path.parent, files=(path.name,))
    if path.name.endswith(TFRECORD_SUFFIX):
        return ImageSource(kind="tfrecord", path=str(path), root=path.parent, files=(path.name,))
    with open(path, "rb") as handle:
        start = handle.read(2)
    if len(start) < 2 or start[0] not in PICKLE_STARTS:
        raise ValueError(
            f"{path} is not a source of images: expected a folder of PNG/JPEG files, a CIFAR batch file "
            f"(a pickle, e.g. test_batch), a .npy uint8 array (N, 32, 32, 3) or {TFRECORD_SUFFIX} shards"
        )
    return ImageSource(kind="batch_file", path=str(path), root=path.parent, files=(path.name,))


def npy_layout(path: str | Path) -> tuple[int, int, bool]:
    """(images, byte offset of the data, C order) of a .npy file of uint8 images (N, 32, 32, 3); ValueError else.

    Only the header is read, with NumPy's own header reader (no pickle, no memory map), and the file must
    hold exactly the bytes its header states: a header can state any shape in a few bytes.
    """
    formats = np.lib.format
    readers = {(1, 0): formats.read_array_header_1_0, (2, 0): formats.read_array_header_2_0}
    expected = (
        "expected uint8 images (N, 32, 32, 3): integers 0..255, channels last (a folder of image files can be "
        "resized with a declared method)"
    )
    try:
        with open(path, "rb") as handle:
            version = formats.read_magic(handle)
            if version not in readers:  # Version 3 is for structured types with non-latin-1 names.
                raise ValueError(f"a version {version[0]}.{version[1]} header")
            shape, fortran_order, dtype = readers[version](handle)
            offset = handle.tell()
            size = os.fstat(handle.fileno()).st_size
    except (ValueError, OSError, EOFError, SyntaxError, RecursionError, tokenize.TokenError) as error:
        # NumPy's reader evaluates the header as a Python literal, tokenizing it to read old-style headers.
        raise ValueError(f"{path} is not a readable .npy file: {error}") from None
    if dtype != np.uint8 or len(shape) != 4 or tuple(shape[1:]) != IMAGE_SHAPE:
        raise ValueError(f"{path} holds {dtype} {tuple(shape)}; {expected}")
    if offset + shape[0] * IMAGE_BYTES != size:
        raise ValueError(
            f"{path} states {shape[0]:,} images in its header but holds {size - offset:,} bytes of them, not "
            f"{shape[0] * IMAGE_BYTES:,}: truncated or damaged"
        )
    return shape[0], offset, not fortran_order


def input_digest(source: ImageSource) -> str:
    """SHA-256 of the source's files (relative names, sizes, bytes; in sorted order) and its resize method."""
    digest = hashlib.sha256(DIGEST_PREFIX)
    digest.update(f"resize={source.resize}\n".encode())
    for name in source.files:
        digest.update(name.encode("utf-8", "surrogateescape") + b"\0")
        if name in source.not_regular:
            digest.update(b"not a regular file\0")
            continue
        with open(source.root / name, "rb") as handle:
            digest.update(os.fstat(handle.fileno()).st_size.to_bytes(8, "little"))
            while chunk := handle.read(CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def read_chunks(source: ImageSource, chunk_size: int = CHUNK_IMAGES) -> Iterator[Chunk]:
    """The source's images, `chunk_size` at a time (fewer at the end of a file), in the source's order."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    readers = {"folder": _folder_chunks, "batch_file": _batch_chunks, "npy": _npy_chunks, "tfrecord": _tfrecord_chunks}
    return readers[source.kind](source, chunk_size)


def read_ahead(source: ImageSource, chunk_size: int = CHUNK_IMAGES, depth: int = 2) -> Iterator[tuple[Chunk, Profile]]:
    """`read_chunks` with each chunk's image profile, made in a thread up to `depth` chunks ahead of the caller.

    Decoding, reading and the drift features are numpy, PIL and file work that release the GIL, so they
    run while the model scores the previous chunk; at most `depth` + 1 chunks are in memory at once.
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def offer(item) -> bool:
        """Puts `item` once there is room; False when the caller has stopped reading."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for chunk in read_chunks(source, chunk_size):
                if not offer((chunk, Profile.of(image_features(chunk.images)) if len(chunk.images) else Profile())):
                    return
            offer(end)
        except BaseException as error:  # Raised in the caller's thread, where it can be handled.
            offer(error)

    producer = threading.Thread(target=produce, name="cifar-read-ahead", daemon=True)
    producer.start()
    try:
        while (item := ready.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        producer.join()


def read_usable(source: ImageSource, chunk_size: int = CHUNK_IMAGES) -> Iterator[tuple[Chunk, Profile]]:
    """`read_ahead`, read up to the source's first image before it returns: a source without one raises
    NoUsableImagesError here, naming every file left out, before anything is scored or recorded."""
    chunks = read_ahead(source, chunk_size)
    before: list[tuple[Chunk, Profile]] = []  # Chunks of problems only: a few lists of names.
    for item in chunks:
        before.append(item)
        if len(item[0].images):
            return _resumed(before, chunks)
    problems = [problem for chunk, _ in before for problem in chunk.problems]
    raise NoUsableImagesError(source.path, problems, f"it holds no images ({KIND_NAMES[source.kind]})")


def _resumed(before: list, rest: Generator) -> Generator:
    """The chunks already read, then the rest; closing it stops the read-ahead thread."""
    try:
        yield from before
        yield from rest
    finally:
        rest.close()


def _folder_chunks(source: ImageSource, chunk_size: int) -> Iterator[Chunk]:
    chunk = Chunk(np.zeros((0, *IMAGE_SHAPE), np.uint8), [], total=len(source.files))
    images: list[np.ndarray] = []
    for relative in source.files:
        chunk.consumed += 1
        if relative in source.not_regular:
            detail = "links and special files are not read"
            chunk.problems.append(FileProblem(file=relative, problem="link", detail=detail))
        else:
            image, problem = decode_image(source.root / relative, source.resize)
            if problem is not None:
                chunk.problems.append(FileProblem(file=relative, problem=problem[0], detail=problem[1]))
            else:
                images.append(image)
                chunk.names.append(relative)
        if len(images) == chunk_size:
            chunk.images = np.stack(images)
            yield chunk
            chunk, images = Chunk(np.zeros((0, *IMAGE_SHAPE), np.uint8), [], total=len(source.files)), []
    if images or chunk.problems:
        if images:
            chunk.images = np.stack(images)
        yield chunk


def _batch_chunks(source: ImageSource, chunk_size: int) -> Iterator[Chunk]:
    from cifar.data.archive import rows_to_images

    name = source.files[0]
    rows, _labels = read_batch_rows(source.root / name)  # (N, 3072); the labels are not the model's business.
    for start in range(0, len(rows), chunk_size):
        stop = min(start + chunk_size, len(rows))
        names = [f"{name}#{index}" for index in range(start, stop)]
        yield Chunk(rows_to_images([rows[start:stop]]), names, consumed=stop - start, total=len(rows))


def _npy_chunks(source: ImageSource, chunk_size: int) -> Iterator[Chunk]:
    # Chunks are read into buffers of their own rather than sliced from a memory map: a mapped page, once
    # touched, counts in the process's resident memory until the kernel needs it back, so a map would grow
    # the RSS to the file's size; a read leaves the bytes in the page cache only.
    name = source.files[0]
    path = source.root / name
    count, offset, c_order = npy_layout(path)
    with open(path, "rb") as handle:
        for start in range(0, count, chunk_size):
            stop = min(start + chunk_size, count)
            if c_order:
                images = np.empty((stop - start, *IMAGE_SHAPE), np.uint8)
                handle.seek(offset + start * IMAGE_BYTES)
                if handle.readinto(memoryview(images).cast("B")) != images.nbytes:
                    raise ValueError(f"{path} ends before its {count:,} images: truncated")
            else:  # Fortran order (rare): copied out of the map.
                images = np.ascontiguousarray(np.load(path, mmap_mode="r", allow_pickle=False)[start:stop])
            names = [f"{name}#{index}" for index in range(start, stop)]
            yield Chunk(images, names, consumed=stop - start, total=count)


def _tfrecord_chunks(source: ImageSource, chunk_size: int) -> Iterator[Chunk]:
    readable, problems = check_shards(source, chunk_size)
    total = sum(count for _, count in readable)
    if problems:
        yield Chunk(np.zeros((0, *IMAGE_SHAPE), np.uint8), [], problems, total=total)
    for name, _count in readable:
        index = 0
        for images in _shard_dataset(source.root / name, chunk_size):
            batch = images.numpy()  # (B, 32, 32, 3)
            names = [f"{name}#{position}" for position in range(index, index + len(batch))]
            yield Chunk(batch, names, consumed=len(batch), total=total)
            index += len(batch)


def _shard_dataset(path: Path, chunk_size: int):
    """The images of one shard in batches: uint8 (B, 32, 32, 3); labels, if any, are not read."""
    import tensorflow as tf

    from cifar.input_pipeline import FEATURES

    def images_of(serialized):
        features = tf.io.parse_example(serialized, {"image": FEATURES["image"]})
        return tf.reshape(tf.io.decode_raw(features["image"], tf.uint8), [-1, *IMAGE_SHAPE])

    return tf.data.TFRecordDataset(str(path)).batch(chunk_size).map(images_of).prefetch(1)


def check_shards(
    source: ImageSource, chunk_size: int = CHUNK_IMAGES
) -> tuple[list[tuple[str, int]], list[FileProblem]]:
    """(readable shards with their image counts, problems): each shard read once to its end before any is scored,
    so a shard that breaks halfway is skipped whole rather than scored in part."""
    import tensorflow as tf

    from cifar.data.convert import framing_problem

    readable, problems = [], []
    for name in source.files:
        framing = framing_problem(source.root / name)  # TensorFlow allocates what a header states: checked first.
        if framing is not None:
            problems.append(FileProblem(file=name, problem="undecodable", detail=framing))
            continue
        count = 0
        try:
            for images in _shard_dataset(source.root / name, chunk_size):
                count += int(images.shape[0])
        except tf.errors.OpError as error:
            detail = f"unreadable after {count:,} images: {error.message.splitlines()[0][:300]}"
            problems.append(FileProblem(file=name, problem="undecodable", detail=detail))
            continue
        except UnicodeDecodeError:  # TensorFlow's error quoted the record's bytes, which are not UTF-8.
            detail = f"unreadable after {count:,} images: a record is not an Example of a 32x32 image"
            problems.append(FileProblem(file=name, problem="undecodable", detail=detail))
            continue
        readable.append((name, count))
    return readable, problems
