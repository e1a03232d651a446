"""The data stage end to end: fetch, convert, manifest, reuse, rebuild and failure cleanup."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from cifar.config import DataConfig
from cifar.data import prepare as prepare_module
from cifar.data.archive import CorruptArchiveError, InvalidDatasetError
from cifar.data.download import ChecksumMismatchError
from cifar.data.manifest import load_manifest
from cifar.data.prepare import IncompleteDataError, prepare_data, verify_data_dir
from cifar.data.synthetic import CLASS_NAMES, source_arrays
from cifar.io import file_digests
from cifar.reuse import data_key

TRAIN_PER_BATCH = 100  # The conftest fixtures: 5 batches of 100 training images, 200 test images.
TEST_EXAMPLES = 200


def _config(source: str, **overrides) -> DataConfig:
    values = dict(
        source=source,
        expect_official_counts=False,
        validation_size=100,
        train_shards=4,
        validation_shards=1,
        test_shards=2,
    )
    return DataConfig(**{**values, **overrides})


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """(mtime_ns, size) of every file, to prove a reuse touched nothing."""
    return {path.name: (path.stat().st_mtime_ns, path.stat().st_size) for path in sorted(directory.iterdir())}


def _data_entries(workdir: Path) -> list[str]:
    """Data directories and temporary ones under WORKDIR/data (the snapshot store's areas left out)."""
    data = workdir / "data"
    store_areas = {"additions", "bases", "snapshots", "rejected"}
    return sorted(name for name in os.listdir(data) if name not in store_areas) if data.exists() else []


def test_prepare_writes_shards_manifest_and_statistics(python_archive, tmp_path):
    result = prepare_data(_config(python_archive), tmp_path)
    assert result.reused is False
    assert result.counts == {"train": 400, "validation": 100, "test": 200}
    data_dir = Path(result.data_dir)
    digests = file_digests(python_archive)
    assert data_dir == tmp_path / "data" / f"cifar10-{data_key(_config(python_archive), digests['sha256'])}"
    assert result.source_sha256 == digests["sha256"]
    assert result.manifest_path == str(data_dir / "manifest.json")

    manifest = load_manifest(data_dir)
    assert manifest.source.model_dump() == {
        "location": python_archive,
        "sha256": digests["sha256"],
        "md5": digests["md5"],
        "layout": "python",
    }
    assert manifest.class_names == list(CLASS_NAMES)
    assert manifest.settings == {
        "validation_size": 100,
        "train_shards": 4,
        "validation_shards": 1,
        "test_shards": 2,
        "near_duplicate_similarity": 0.97,
    }
    assert [len(manifest.splits[split].shards) for split in ("train", "validation", "test")] == [4, 1, 2]
    train_images, train_labels = source_arrays(train_per_batch=TRAIN_PER_BATCH, test_examples=TEST_EXAMPLES)["train"]
    assert manifest.splits["train"].class_counts == np.bincount(train_labels[:400], minlength=10).tolist()
    pixels = train_images[:400].reshape(-1, 3) / 255.0
    np.testing.assert_allclose(manifest.mean, pixels.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(manifest.std, pixels.std(axis=0), rtol=1e-12)
    assert pq.read_table(data_dir / manifest.statistics_file).column("mean").to_pylist() == manifest.mean
    assert pq.read_table(data_dir / manifest.class_histogram_file).num_rows == 30
    verify_data_dir(data_dir)
    assert _data_entries(tmp_path) == [data_dir.name]  # No temporary directory left behind.


def test_a_second_call_reuses_the_directory_without_touching_it(python_archive, tmp_path):
    first = prepare_data(_config(python_archive), tmp_path)
    before = _snapshot(Path(first.data_dir))
    second = prepare_data(_config(python_archive), tmp_path)
    assert second.reused is True
    assert second.model_dump(exclude={"reused"}) == first.model_dump(exclude={"reused"})
    assert _snapshot(Path(first.data_dir)) == before


def test_the_same_inputs_give_identical_bytes_in_another_workdir(python_archive, tmp_path):
    first = Path(prepare_data(_config(python_archive), tmp_path / "one").data_dir)
    second = Path(prepare_data(_config(python_archive), tmp_path / "two").data_dir)
    assert first.name == second.name
    assert sorted(os.listdir(first)) == sorted(os.listdir(second))
    for name in os.listdir(first):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_binary_and_python_layouts_give_the_same_shards(python_archive, binary_archive, tmp_path):
    from_python = load_manifest(prepare_data(_config(python_archive), tmp_path / "py").data_dir)
    from_binary = load_manifest(prepare_data(_config(binary_archive), tmp_path / "bin").data_dir)
    assert from_binary.source.layout == "binary"
    assert from_binary.splits == from_python.splits
    assert from_binary.mean == from_python.mean


@pytest.mark.slow
def test_settings_change_the_key_and_the_directory(python_archive, tmp_path):
    digest = "a" * 64
    assert data_key(_config(python_archive), digest) == data_key(_config("elsewhere"), digest)
    assert data_key(_config(python_archive), digest) != data_key(_config(python_archive, validation_size=50), digest)
    assert data_key(_config(python_archive), digest) != data_key(_config(python_archive), "b" * 64)
    assert data_key(_config(python_archive), digest) != data_key(_config(python_archive, train_shards=5), digest)
    first = prepare_data(_config(python_archive), tmp_path)
    second = prepare_data(_config(python_archive, validation_size=0), tmp_path)
    assert second.reused is False and second.data_dir != first.data_dir
    assert second.counts == {"train": 500, "validation": 0, "test": 200}
    assert load_manifest(second.data_dir).splits["validation"].shards == []


def test_a_wrong_checksum_leaves_nothing_in_data(python_archive, tmp_path):
    with pytest.raises(ChecksumMismatchError, match="sha256 mismatch"):
        prepare_data(_config(python_archive, sha256="0" * 64), tmp_path)
    assert _data_entries(tmp_path) == []


def test_a_corrupt_archive_leaves_nothing_in_data(python_archive, tmp_path):
    truncated = tmp_path / "truncated.tar.gz"
    data = Path(python_archive).read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptArchiveError, match="truncated or corrupt"):
        prepare_data(_config(str(truncated)), tmp_path / "work")
    assert _data_entries(tmp_path / "work") == []


def test_official_counts_are_required_unless_disabled(python_archive, tmp_path):
    with pytest.raises(InvalidDatasetError, match="expected the official 50,000 and 10,000"):
        prepare_data(_config(python_archive, expect_official_counts=True), tmp_path)
    assert _data_entries(tmp_path) == []


def test_a_deleted_shard_is_detected_and_rebuilt(python_archive, tmp_path):
    first = prepare_data(_config(python_archive), tmp_path)
    shard = Path(first.data_dir) / "train-00002-of-00004.tfrecord"
    expected = shard.read_bytes()
    shard.unlink()
    with pytest.raises(IncompleteDataError, match="train-00002-of-00004.tfrecord is missing"):
        verify_data_dir(first.data_dir)
    second = prepare_data(_config(python_archive), tmp_path)
    assert second.reused is False and second.data_dir == first.data_dir
    assert shard.read_bytes() == expected
    verify_data_dir(second.data_dir)


@pytest.mark.slow
def test_a_truncated_shard_or_a_missing_manifest_is_rebuilt(python_archive, tmp_path):
    first = prepare_data(_config(python_archive), tmp_path)
    data_dir = Path(first.data_dir)
    shard = data_dir / "test-00001-of-00002.tfrecord"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert prepare_data(_config(python_archive), tmp_path).reused is False
    (data_dir / "manifest.json").unlink()
    assert prepare_data(_config(python_archive), tmp_path).reused is False
    assert prepare_data(_config(python_archive), tmp_path).reused is True


def test_verify_data_dir_catches_a_changed_byte(python_archive, tmp_path):
    data_dir = Path(prepare_data(_config(python_archive), tmp_path).data_dir)
    shard = data_dir / "validation-00000-of-00001.tfrecord"
    data = bytearray(shard.read_bytes())
    data[500] ^= 0xFF  # Same size, so only the full check can notice.
    shard.write_bytes(bytes(data))
    with pytest.raises(IncompleteDataError, match="validation-00000-of-00001.tfrecord has sha256"):
        verify_data_dir(data_dir)


def test_a_directory_made_under_another_key_is_not_reused(python_archive, tmp_path):
    first = prepare_data(_config(python_archive), tmp_path)
    manifest_path = Path(first.manifest_path)
    manifest = json.loads(manifest_path.read_text())
    manifest["key"] = "0123456789abcdef"  # As if other settings or other code wrote this directory.
    manifest_path.write_text(json.dumps(manifest))
    assert prepare_data(_config(python_archive), tmp_path).reused is False


def test_progress_is_reported_and_logged(python_archive, tmp_path, caplog):
    calls: list[tuple[str, float]] = []
    with caplog.at_level(logging.INFO, logger="cifar.data"):
        prepare_data(_config(python_archive), tmp_path, progress=lambda step, fraction: calls.append((step, fraction)))
    steps = [step for step, _ in calls]
    for step in ("fetch", "read", "validate", "convert", "statistics"):
        assert step in steps
    fractions = [fraction for _, fraction in calls]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    assert steps.count("convert") == 1 + 7  # The start, then once per shard.
    messages = [record.getMessage() for record in caplog.records if record.name.startswith("cifar.data")]
    assert any("7 of 7 shards written" in message for message in messages)
    assert any("Reading" in message for message in messages)


def test_a_stale_partial_directory_does_not_block_a_rebuild(python_archive, tmp_path):
    first = prepare_data(_config(python_archive), tmp_path)
    data_dir = Path(first.data_dir)
    shutil.rmtree(data_dir)
    data_dir.mkdir()
    (data_dir / "train-00000-of-00004.tfrecord").write_bytes(b"half")
    second = prepare_data(_config(python_archive), tmp_path)
    assert second.reused is False
    verify_data_dir(second.data_dir)


def test_a_file_url_source_is_read_like_a_path(python_archive, tmp_path):
    by_path = prepare_data(_config(python_archive), tmp_path)
    by_url = prepare_data(_config(Path(python_archive).as_uri()), tmp_path)
    assert by_url.data_dir == by_path.data_dir and by_url.reused is True


def test_a_reuse_does_no_reading_or_conversion(python_archive, tmp_path, monkeypatch):
    prepare_data(_config(python_archive), tmp_path)
    calls: list[str] = []
    monkeypatch.setattr(prepare_module, "read_archive", lambda *args, **kwargs: calls.append("read"))
    monkeypatch.setattr(prepare_module, "convert_splits", lambda *args, **kwargs: calls.append("convert"))
    assert prepare_data(_config(python_archive), tmp_path).reused is True
    assert calls == []
