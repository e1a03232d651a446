"""Checks that what the archive holds is CIFAR-10 shaped: rows, labels, class names and counts.

Batch checks (`validate_batch`, `validate_class_names`) run while the archive is read, so an error
names the file it came from; `validate_dataset` checks the assembled dataset against the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cifar.config import TEST_EXAMPLES, TRAIN_EXAMPLES, DataConfig
from cifar.data.manifest import IMAGE_BYTES, IMAGE_SHAPE, NUM_CLASSES

if TYPE_CHECKING:
    from cifar.data.archive import RawDataset


class InvalidDatasetError(ValueError):
    """The archive's contents are not a well-formed CIFAR-10 dataset."""


def validate_batch(name: str, data: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """Checks one batch (`data` uint8 (N, 3072), N labels in 0..9); returns (rows, labels as int64)."""
    if not isinstance(data, np.ndarray):
        raise InvalidDatasetError(f"{name}: data is a {type(data).__name__}, expected a numpy array")
    if data.dtype != np.uint8:
        raise InvalidDatasetError(f"{name}: data has dtype {data.dtype}, expected uint8")
    if data.ndim != 2 or data.shape[1] != IMAGE_BYTES:
        raise InvalidDatasetError(f"{name}: data has shape {data.shape}, expected (N, {IMAGE_BYTES})")
    try:
        array = np.asarray(labels)
    except (TypeError, ValueError) as error:
        raise InvalidDatasetError(f"{name}: labels are not a list of integers: {error}") from error
    if array.ndim != 1:
        raise InvalidDatasetError(f"{name}: labels have shape {array.shape}, expected a flat list")
    if len(array) and not np.issubdtype(array.dtype, np.integer):
        raise InvalidDatasetError(f"{name}: labels have type {array.dtype}, expected integers")
    if len(array) != len(data):
        raise InvalidDatasetError(f"{name}: {len(array)} labels for {len(data)} images")
    labels = array.astype(np.int64)
    _check_label_range(name, labels)
    return data, labels


def _check_label_range(name: str, labels: np.ndarray) -> None:
    """Every label must be a class index."""
    outside = np.flatnonzero((labels < 0) | (labels >= NUM_CLASSES))
    if len(outside):
        first = int(outside[0])
        raise InvalidDatasetError(
            f"{name}: {len(outside)} labels outside 0..{NUM_CLASSES - 1}, "
            f"first at index {first} (value {int(labels[first])})"
        )


def validate_class_names(name: str, class_names: list[Any]) -> list[str]:
    """Exactly 10 distinct, non-empty class names."""
    if len(class_names) != NUM_CLASSES:
        raise InvalidDatasetError(f"{name}: {len(class_names)} class names, expected {NUM_CLASSES}")
    if not all(isinstance(item, str) and item.strip() for item in class_names):
        raise InvalidDatasetError(f"{name}: class names must be non-empty strings, got {class_names!r}")
    if len(set(class_names)) != NUM_CLASSES:
        raise InvalidDatasetError(f"{name}: class names are not distinct: {class_names!r}")
    return list(class_names)


def _validate_split(split: str, images: np.ndarray, labels: np.ndarray) -> None:
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != IMAGE_SHAPE:
        raise InvalidDatasetError(
            f"{split} images have shape {images.shape} and dtype {images.dtype}, expected (N, 32, 32, 3) uint8"
        )
    if labels.ndim != 1 or len(labels) != len(images):
        raise InvalidDatasetError(f"{split}: {labels.shape[0] if labels.ndim else 0} labels for {len(images)} images")
    _check_label_range(split, labels)


def validate_dataset(dataset: RawDataset, config: DataConfig) -> None:
    """Checks the assembled dataset's shapes, labels, class names and counts against `config`."""
    _validate_split("train", dataset.train_images, dataset.train_labels)
    _validate_split("test", dataset.test_images, dataset.test_labels)
    validate_class_names("class names", dataset.class_names)
    num_train, num_test = len(dataset.train_images), len(dataset.test_images)
    if config.expect_official_counts and (num_train, num_test) != (TRAIN_EXAMPLES, TEST_EXAMPLES):
        raise InvalidDatasetError(
            f"archive holds {num_train:,} training and {num_test:,} test images, expected the official "
            f"{TRAIN_EXAMPLES:,} and {TEST_EXAMPLES:,} (set data.expect_official_counts to false for other sizes)"
        )
    if num_test == 0:
        raise InvalidDatasetError("archive holds no test images")
    if config.validation_size >= num_train:
        raise InvalidDatasetError(
            f"validation_size {config.validation_size:,} leaves no training images out of {num_train:,}"
        )
