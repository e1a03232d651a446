"""The input pipeline: contract shapes and dtypes, exactly-once evaluation, determinism, augmentation."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import tensorflow as tf

from cifar.config import DataConfig
from cifar.data.manifest import load_manifest
from cifar.data.prepare import prepare_data
from cifar.input_pipeline import (
    center_crop,
    make_eval_dataset,
    make_train_dataset,
    per_replica_batch_size,
    random_crop_flip,
)


@pytest.fixture(scope="module")
def data_dir(python_archive, tmp_path_factory) -> str:
    config = DataConfig(source=python_archive, expect_official_counts=False, validation_size=100)
    return prepare_data(config, tmp_path_factory.mktemp("pipeline-work")).data_dir


def train_batches(data_dir, count, **overrides):
    settings = dict(splits=["train"], batch_size=32, image_size=32, seed=7, deterministic=True)
    settings.update(overrides)
    dataset = make_train_dataset(data_dir, **settings)
    return [(images.numpy(), labels.numpy()) for images, labels in dataset.take(count)]


@pytest.mark.parametrize("image_size", [32, 24])
def test_train_batches_are_full_global_batches_of_uint8_images_and_int32_labels(data_dir, image_size):
    for images, labels in train_batches(data_dir, 3, image_size=image_size):
        assert images.shape == (32, image_size, image_size, 3)
        assert images.dtype == np.uint8
        assert labels.shape == (32,)
        assert labels.dtype == np.int32
        assert set(labels.tolist()) <= set(range(10))


@pytest.mark.parametrize(("split", "batch_size"), [("validation", 32), ("test", 64), ("test", 200)])
def test_evaluation_sees_every_example_exactly_once(data_dir, split, batch_size):
    manifest = load_manifest(data_dir)
    dataset = make_eval_dataset(data_dir, splits=[split], batch_size=batch_size, image_size=32)
    labels = np.concatenate([batch_labels.numpy() for _, batch_labels in dataset])
    assert len(labels) == manifest.splits[split].num_examples
    counts = collections.Counter(labels.tolist())
    assert [counts[label] for label in range(10)] == manifest.splits[split].class_counts
    # The stated cardinality matches what the dataset yields (the last batch may be short).
    assert int(dataset.cardinality()) == -(-len(labels) // batch_size)


def test_evaluation_images_are_the_stored_pixels_in_file_order(data_dir):
    full = make_eval_dataset(data_dir, splits=["test"], batch_size=50, image_size=32)
    cropped = make_eval_dataset(data_dir, splits=["test"], batch_size=50, image_size=24)
    first_full, _ = next(iter(full))
    first_cropped, _ = next(iter(cropped))
    # The tutorial model's evaluation input is the centre 24x24 window.
    np.testing.assert_array_equal(first_cropped.numpy(), first_full.numpy()[:, 4:28, 4:28, :])


def test_deterministic_mode_gives_identical_batches_for_the_same_seed(data_dir):
    first = train_batches(data_dir, 4)
    second = train_batches(data_dir, 4)
    for (images_a, labels_a), (images_b, labels_b) in zip(first, second):
        np.testing.assert_array_equal(images_a, images_b)
        np.testing.assert_array_equal(labels_a, labels_b)
    other_seed = train_batches(data_dir, 1, seed=8)
    assert not np.array_equal(first[0][0], other_seed[0][0])


def _is_crop_of(augmented: np.ndarray, original: np.ndarray, pad: int) -> bool:
    """Whether `augmented` is a (possibly flipped) window of the zero-padded original."""
    size = augmented.shape[0]
    padded = np.pad(original, [(pad, pad), (pad, pad), (0, 0)])
    for row in range(padded.shape[0] - size + 1):
        for column in range(padded.shape[1] - size + 1):
            window = padded[row : row + size, column : column + size]
            if np.array_equal(window, augmented) or np.array_equal(window[:, ::-1], augmented):
                return True
    return False


@pytest.mark.parametrize(("image_size", "pad"), [(32, 4), (24, 0)])
def test_augmentation_changes_images_but_only_crops_and_flips_source_pixels(data_dir, image_size, pad):
    # The shuffle does not depend on augmentation, so both streams hold the same examples.
    ((plain, plain_labels),) = train_batches(data_dir, 1, augment=False, image_size=32)
    ((augmented, labels),) = train_batches(data_dir, 1, augment=True, image_size=image_size)
    np.testing.assert_array_equal(plain_labels, labels)
    if image_size == 32:
        assert not np.array_equal(plain, augmented)
    for index in range(len(labels)):
        assert _is_crop_of(augmented[index], plain[index], pad), f"image {index} is not a crop/flip of its source"


def test_random_crop_flip_is_a_batched_gather_of_windows():
    images = tf.reshape(tf.range(2 * 6 * 6 * 1) % 251, [2, 6, 6, 1])
    images = tf.cast(images, tf.uint8)
    cropped = random_crop_flip(images, 4, 0, tf.constant([1, 2], tf.int64)).numpy()
    assert cropped.shape == (2, 4, 4, 1)
    for index in range(2):
        assert _is_crop_of(cropped[index], images.numpy()[index], 0)
    again = random_crop_flip(images, 4, 0, tf.constant([1, 2], tf.int64)).numpy()
    np.testing.assert_array_equal(cropped, again)
    np.testing.assert_array_equal(center_crop(images, 4).numpy(), images.numpy()[:, 1:5, 1:5, :])


def test_global_batch_splits_evenly_into_per_replica_batches():
    assert per_replica_batch_size(128, 1) == 128
    assert per_replica_batch_size(128, 2) == 64
    with pytest.raises(ValueError, match="divisible by the 3 replicas"):
        per_replica_batch_size(128, 3)


def test_train_dataset_shards_by_element_across_workers(data_dir):
    dataset = make_train_dataset(data_dir, splits=["train"], batch_size=32, image_size=32, seed=0)
    policy = dataset.options().experimental_distribute.auto_shard_policy
    assert policy == tf.data.experimental.AutoShardPolicy.DATA


def test_training_runs_without_the_autotuner_whose_thread_stalls_teardown(data_dir):
    # Destroying an autotuned iterator waits out the autotuner's sleep (up to 60 s after fit).
    train = make_train_dataset(data_dir, splits=["train"], batch_size=32, image_size=32, seed=0)
    assert train.options().autotune.enabled is False
    evaluation = make_eval_dataset(data_dir, splits=["test"], batch_size=32, image_size=32)
    assert evaluation.options().autotune.enabled is not False


def test_empty_split_is_a_clear_error(data_dir):
    with pytest.raises((ValueError, KeyError)):
        make_eval_dataset(data_dir, splits=["missing"], batch_size=10, image_size=32)
