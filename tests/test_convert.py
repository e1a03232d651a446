"""Conversion to TFRecord shards: the proto bytes, splits, shard layout, round trip and statistics."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from cifar.config import DataConfig
from cifar.data.archive import read_archive
from cifar.data.convert import (
    FRAMED_RECORD_BYTES,
    RECORD_BYTES,
    class_counts,
    convert_dataset,
    encode_examples,
    encode_records,
    shard_bounds,
    shard_name,
    write_shard,
)
from cifar.data.manifest import Split
from cifar.data.stats import channel_statistics, write_class_histogram, write_statistics
from cifar.data.synthetic import CLASS_NAMES, source_arrays

TRAIN_PER_BATCH = 100  # The conftest fixtures: 5 batches of 100 training images, 200 test images.
TEST_EXAMPLES = 200
FEATURES = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}


def _config(**overrides) -> DataConfig:
    values = dict(
        source="unused",
        expect_official_counts=False,
        validation_size=100,
        train_shards=3,
        validation_shards=2,
        test_shards=2,
    )
    return DataConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def dataset(python_archive):
    return read_archive(python_archive)


def _read_records(paths: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Every example of the shards, parsed with TensorFlow's own parser."""
    images, labels = [], []
    for record in tf.data.TFRecordDataset(paths):
        example = tf.io.parse_single_example(record, FEATURES)
        images.append(np.frombuffer(example["image"].numpy(), dtype=np.uint8).reshape(32, 32, 3))
        labels.append(int(example["label"]))
    return np.stack(images), np.array(labels, dtype=np.int64)


def test_encoded_examples_are_byte_identical_to_tensorflow_protos():
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(5, 32, 32, 3), dtype=np.uint8)
    labels = np.array([0, 9, 3, 7, 1])
    records = encode_examples(images, labels)
    assert records.shape == (5, RECORD_BYTES) and records.dtype == np.uint8
    for image, label, record in zip(images, labels, records):
        example = tf.train.Example(
            features=tf.train.Features(
                feature={
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image.tobytes()])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
                }
            )
        )
        assert record.tobytes() == example.SerializeToString(deterministic=True)


def test_shards_are_byte_identical_to_tensorflow_record_writer_output(tmp_path):
    rng = np.random.default_rng(4)
    images = rng.integers(0, 256, size=(7, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=7)
    shard = write_shard(tmp_path / "ours.tfrecord", encode_records(images, labels))
    with tf.io.TFRecordWriter(str(tmp_path / "tensorflow.tfrecord")) as writer:
        for record in encode_examples(images, labels):
            writer.write(record.tobytes())
    ours = (tmp_path / "ours.tfrecord").read_bytes()
    assert ours == (tmp_path / "tensorflow.tfrecord").read_bytes()
    assert shard.num_examples == 7 and shard.num_bytes == len(ours) == 7 * FRAMED_RECORD_BYTES


def test_encode_examples_rejects_bad_input():
    with pytest.raises(ValueError, match="uint8"):
        encode_examples(np.zeros((1, 32, 32, 3), np.float32), np.array([0]))
    with pytest.raises(ValueError, match="0..127"):
        encode_examples(np.zeros((1, 32, 32, 3), np.uint8), np.array([200]))


@pytest.mark.parametrize(
    "num_examples, num_shards, expected",
    [
        (10, 3, [(0, 3), (3, 6), (6, 10)]),
        (2, 8, [(0, 1), (1, 2)]),  # Never more shards than examples.
        (0, 4, []),  # An empty split has no shards.
        (5, 1, [(0, 5)]),
    ],
)
def test_shard_bounds(num_examples, num_shards, expected):
    assert shard_bounds(num_examples, num_shards) == expected


def test_shard_name():
    assert shard_name("train", 0, 8) == "train-00000-of-00008.tfrecord"


def test_splits_counts_and_shards(dataset, tmp_path):
    splits = convert_dataset(dataset, _config(), tmp_path)
    expected = source_arrays(train_per_batch=TRAIN_PER_BATCH, test_examples=TEST_EXAMPLES)
    train_labels, test_labels = expected["train"][1], expected["test"][1]
    assert {split: entry.num_examples for split, entry in splits.items()} == {
        "train": 400,
        "validation": 100,
        "test": 200,
    }
    assert splits["train"].class_counts == np.bincount(train_labels[:400], minlength=10).tolist()
    assert splits["validation"].class_counts == np.bincount(train_labels[400:], minlength=10).tolist()
    assert splits["test"].class_counts == np.bincount(test_labels, minlength=10).tolist()
    assert [shard.path for shard in splits["train"].shards] == [
        "train-00000-of-00003.tfrecord",
        "train-00001-of-00003.tfrecord",
        "train-00002-of-00003.tfrecord",
    ]
    assert [shard.num_examples for shard in splits["train"].shards] == [133, 133, 134]
    assert len(splits["validation"].shards) == 2 and len(splits["test"].shards) == 2
    for entry in splits.values():
        for shard in entry.shards:
            assert (tmp_path / shard.path).stat().st_size == shard.num_bytes == shard.num_examples * FRAMED_RECORD_BYTES
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        shard.path for entry in splits.values() for shard in entry.shards
    )


def test_records_round_trip_to_the_source_pixels_and_labels(dataset, tmp_path):
    splits = convert_dataset(dataset, _config(), tmp_path)
    expected = source_arrays(train_per_batch=TRAIN_PER_BATCH, test_examples=TEST_EXAMPLES)
    train_images, train_labels = expected["train"]
    parsed = {
        split: _read_records([str(tmp_path / shard.path) for shard in entry.shards]) for split, entry in splits.items()
    }
    np.testing.assert_array_equal(parsed["train"][0], train_images[:400])
    np.testing.assert_array_equal(parsed["train"][1], train_labels[:400])
    np.testing.assert_array_equal(parsed["validation"][0], train_images[400:])
    np.testing.assert_array_equal(parsed["validation"][1], train_labels[400:])
    np.testing.assert_array_equal(parsed["test"][0], expected["test"][0])
    np.testing.assert_array_equal(parsed["test"][1], expected["test"][1])


def test_a_zero_validation_size_gives_an_empty_split_without_shards(dataset, tmp_path):
    splits = convert_dataset(dataset, _config(validation_size=0), tmp_path)
    assert splits["validation"] == Split(num_examples=0, class_counts=[0] * 10, shards=[])
    assert splits["train"].num_examples == 500
    assert not list(tmp_path.glob("validation-*"))


def test_a_tiny_split_gets_one_shard_per_example(dataset, tmp_path):
    splits = convert_dataset(dataset, _config(validation_size=3, validation_shards=8), tmp_path)
    assert [shard.path for shard in splits["validation"].shards] == [
        f"validation-0000{index}-of-00003.tfrecord" for index in range(3)
    ]


def test_conversion_is_byte_identical_across_runs(dataset, tmp_path):
    first = convert_dataset(dataset, _config(), tmp_path / "first")
    second = convert_dataset(dataset, _config(), tmp_path / "second")
    assert first == second  # Same paths, sizes, counts and sha256 of every shard.
    for entry in first.values():
        for shard in entry.shards:
            assert (tmp_path / "first" / shard.path).read_bytes() == (tmp_path / "second" / shard.path).read_bytes()


def test_channel_statistics_match_numpy(dataset):
    mean, std = channel_statistics(dataset.train_images)
    pixels = dataset.train_images.reshape(-1, 3).astype(np.float64) / 255.0
    np.testing.assert_allclose(mean, pixels.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(std, pixels.std(axis=0), rtol=1e-12)


def test_channel_statistics_reject_empty_input():
    with pytest.raises(ValueError, match="non-empty uint8"):
        channel_statistics(np.zeros((0, 32, 32, 3), np.uint8))


def test_statistics_and_class_histogram_parquet(dataset, tmp_path):
    splits = convert_dataset(dataset, _config(), tmp_path / "shards")
    mean, std = channel_statistics(dataset.train_images[:400])
    statistics = pq.read_table(write_statistics(tmp_path, mean, std, 400)).to_pylist()
    assert [row["channel"] for row in statistics] == ["red", "green", "blue"]
    assert [row["mean"] for row in statistics] == mean and [row["std"] for row in statistics] == std
    assert {row["num_examples"] for row in statistics} == {400}
    histogram = pq.read_table(write_class_histogram(tmp_path, splits, list(CLASS_NAMES))).to_pylist()
    assert len(histogram) == 30
    for row in histogram:
        assert row["class_name"] == CLASS_NAMES[row["class_id"]]
        assert row["count"] == splits[row["split"]].class_counts[row["class_id"]]
    assert class_counts(np.array([0, 0, 9])) == [2, 0, 0, 0, 0, 0, 0, 0, 0, 1]
