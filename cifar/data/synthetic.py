"""Small CIFAR-10 look-alike archives in the exact official layouts, for tests and demos.

The images are learnable: every class has its own colour and stripe orientation, plus noise, so a
tiny model beats chance within an epoch or two. Each image also has its own stripe phase and width
and a soft blob in a random place, so no two images are near-duplicates of each other (as with real
photographs) unless a test makes them so. Same seed, same bytes.
"""

from __future__ import annotations

import gzip
import io
import pickle
import tarfile
from pathlib import Path

import numpy as np

from cifar.data.manifest import IMAGE_BYTES

CLASS_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
NUM_TRAIN_BATCHES = 5
PYTHON_DIR = "cifar-10-batches-py"
BINARY_DIR = "cifar-10-batches-bin"
FIXED_MTIME = 1_262_304_000  # 2010-01-01: fixed so archives are byte-identical across runs.


def make_images(labels: np.ndarray, seed: int) -> np.ndarray:
    """Learnable uint8 images, shape (N, 32, 32, 3), for the given labels."""
    rng = np.random.default_rng(seed)
    palette = np.random.default_rng(12345).integers(40, 216, size=(10, 3))
    rows, columns = np.mgrid[0:32, 0:32]
    images = np.empty((len(labels), 32, 32, 3), dtype=np.uint8)
    for index, label in enumerate(labels):
        angle = np.pi * label / 10.0
        width, phase = rng.uniform(0.25, 0.45), rng.uniform(0, 2 * np.pi)  # Periods of 14-25 pixels.
        stripes = np.sin((rows * np.cos(angle) + columns * np.sin(angle)) * width + phase)  # (32, 32)
        image = palette[label][None, None, :] + rng.uniform(20, 35) * stripes[..., None]
        for _ in range(4):  # Soft blobs in random places: each image's own low-frequency content.
            centre, radius = rng.uniform(2, 30, size=2), rng.uniform(3, 8)
            blob = np.exp(-((rows - centre[0]) ** 2 + (columns - centre[1]) ** 2) / (2 * radius**2))
            image = image + rng.uniform(-80, 80) * blob[..., None]
        image += rng.normal(0.0, 20.0, size=image.shape)
        images[index] = np.clip(image, 0, 255).astype(np.uint8)
    return images


def make_split(num_examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Balanced labels (shuffled) and their images."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(num_examples) % 10).astype(np.int64)
    return make_images(labels, seed + 1), labels


def _to_rows(images: np.ndarray) -> np.ndarray:
    """(N, 32, 32, 3) HWC -> (N, 3072) rows in the official channel-major order (R plane, G, B)."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), IMAGE_BYTES))


def _python_batch(images: np.ndarray, labels: np.ndarray, name: str) -> bytes:
    batch = {
        b"batch_label": name.encode(),
        b"labels": [int(label) for label in labels],
        b"data": _to_rows(images),
        b"filenames": [f"{name}_{index:05d}.png".encode() for index in range(len(labels))],
    }
    return pickle.dumps(batch, protocol=2)


def _binary_batch(images: np.ndarray, labels: np.ndarray, name: str) -> bytes:
    return np.concatenate([labels.astype(np.uint8)[:, None], _to_rows(images)], axis=1).tobytes()


def _write_gzip_tar(path: Path, files: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = FIXED_MTIME
            info.mode = 0o644
            archive.addfile(info, io.BytesIO(data))
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as handle:
        handle.write(buffer.getvalue())
    return path


def build_archive(
    path: str | Path,
    *,
    train_per_batch: int = 100,
    test_examples: int = 200,
    layout: str = "python",
    seed: int = 0,
    train_batches: int = NUM_TRAIN_BATCHES,
) -> Path:
    """Writes a gzipped tar in the official `python` or `binary` layout and returns its path.

    `train_batches` < 5 leaves the last batches out (an archive to which they are added later).
    """
    if layout not in {"python", "binary"}:
        raise ValueError(f"layout must be 'python' or 'binary', got {layout!r}")
    arrays = source_arrays(train_per_batch=train_per_batch, test_examples=test_examples, seed=seed)
    (train_images, train_labels), (test_images, test_labels) = arrays["train"], arrays["test"]
    python = layout == "python"
    directory, suffix, encode = (PYTHON_DIR, "", _python_batch) if python else (BINARY_DIR, ".bin", _binary_batch)
    files: dict[str, bytes] = {}
    for batch in range(train_batches):
        part = slice(batch * train_per_batch, (batch + 1) * train_per_batch)
        name = f"data_batch_{batch + 1}"
        files[f"{directory}/{name}{suffix}"] = encode(train_images[part], train_labels[part], name)
    files[f"{directory}/test_batch{suffix}"] = encode(test_images, test_labels, "test_batch")
    if python:
        meta = {
            b"num_cases_per_batch": train_per_batch,
            b"label_names": [n.encode() for n in CLASS_NAMES],
            b"num_vis": IMAGE_BYTES,
        }
        files[f"{PYTHON_DIR}/batches.meta"] = pickle.dumps(meta, protocol=2)
    else:
        files[f"{BINARY_DIR}/batches.meta.txt"] = ("\n".join(CLASS_NAMES) + "\n\n").encode()
    files[f"{directory}/readme.html"] = b"<html>synthetic CIFAR-10 fixture</html>\n"
    return _write_gzip_tar(Path(path), files)


def source_arrays(
    *, train_per_batch: int = 100, test_examples: int = 200, seed: int = 0
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The (images HWC uint8, labels) that `build_archive` with the same arguments writes."""
    return {
        "train": make_split(train_per_batch * NUM_TRAIN_BATCHES, seed),
        "test": make_split(test_examples, seed + 100),
    }


def write_batch_file(path: str | Path, images: np.ndarray, labels: np.ndarray, name: str = "data_batch_6") -> Path:
    """A CIFAR batch file (the pickle layout of data_batch_N) holding `images` (N, 32, 32, 3) and `labels`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_python_batch(images, np.asarray(labels), name))
    return path


def write_image_folder(
    path: str | Path, images: np.ndarray, labels: np.ndarray, *, image_format: str = "png", quality: int = 95
) -> Path:
    """PATH/<class name>/<index>.<png|jpg>: an addition folder in the layout `flows/ingest.py --add` reads."""
    from PIL import Image

    root = Path(path)
    suffix = {"png": "png", "jpeg": "jpg"}[image_format]
    for index, (image, label) in enumerate(zip(images, labels)):
        target = root / CLASS_NAMES[int(label)] / f"{index:05d}.{suffix}"
        target.parent.mkdir(parents=True, exist_ok=True)
        options = {"quality": quality} if image_format == "jpeg" else {}
        Image.fromarray(image).save(target, format=image_format.upper(), **options)
    return root
