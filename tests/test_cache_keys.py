"""Cache keys change exactly when a stage's inputs, settings or code change; stale results are never returned."""

from __future__ import annotations

import os
import shutil

import pytest
from prefect.filesystems import LocalFileSystem
from prefect.results import ResultStore
from prefect.serializers import JSONSerializer

from cifar.config import make_config
from tasks import caching
from tasks.caching import code_version, expire_if_invalid, fingerprint, stage_key
from tasks.data import Archive, Dataset, archive_key, dataset_is_valid, dataset_key
from tasks.evaluation import Evaluation, evaluation_key, export_key
from tasks.training import Training, training_key

SHA_A, SHA_B = "a" * 64, "b" * 64


def archive(sha256: str = SHA_A, path: str = "/data/cifar-10-python.tar.gz") -> Archive:
    return Archive(path=path, sha256=sha256, md5="0" * 32, source=path, fingerprint="f")


def dataset(manifest_sha256: str = SHA_A, data_dir: str = "/w/data/cifar10-x") -> Dataset:
    return Dataset(data_dir=data_dir, manifest_path=f"{data_dir}/manifest.json", source_sha256=SHA_A, reused=False,
                   counts={"train": 1}, manifest_sha256=manifest_sha256, fingerprint="f")


def training(checkpoints: str = "c1") -> Training:
    return Training(run_name="r", run_dir="/w/runs/r", checkpoint_dir="/w/runs/r/checkpoints", mlflow_run_id="m",
                    tracking_uri="sqlite:///w/mlflow.db", epochs_completed=2, best_epoch=2, val_accuracy=0.5,
                    metrics={}, fingerprint=checkpoints)


def evaluation(test_accuracy: float = 0.5) -> Evaluation:
    return Evaluation(epoch=2, test_accuracy=test_accuracy, test_loss=1.0, metrics_path="/m", predictions_path="/p",
                      fingerprint="e")


def config(**sections):
    return make_config("smoke", sections)


# The data stage.


def test_data_key_follows_the_archive_content_and_the_shard_settings():
    base = dataset_key(config(), archive())
    assert dataset_key(config(), archive()) == base  # Deterministic.
    assert dataset_key(config(), archive(SHA_B)) != base
    assert dataset_key(config(data={"validation_size": 100}), archive()) != base
    assert dataset_key(config(data={"train_shards": 4}), archive()) != base
    assert dataset_key(config(data={"expect_official_counts": False}), archive()) != base


@pytest.mark.parametrize("irrelevant", [
    {"evaluate": {"batch_size": 100, "flip_tta": True}},
    {"train": {"epochs": 9, "model": "tiny"}},
    {"export": {"min_accuracy": 0.9}},
    {"seed": 3},
    {"data": {"source": "/elsewhere/same-bytes.tar.gz", "download_retries": 9}},
])
def test_data_key_ignores_what_cannot_change_the_shards(irrelevant):
    moved = archive(path="/elsewhere/same-bytes.tar.gz")
    assert dataset_key(config(**irrelevant), moved) == dataset_key(config(), archive())


def test_download_key_follows_the_source_and_expected_digests_only():
    base = archive_key(config(data={"source": "/a.tar.gz"}))
    assert archive_key(config(data={"source": "/b.tar.gz"})) != base
    assert archive_key(config(data={"source": "/a.tar.gz", "sha256": SHA_A})) != base
    assert archive_key(config(data={"source": "/a.tar.gz", "validation_size": 10})) == base


# Training and after.


def test_training_key_follows_data_content_training_settings_seed_and_store():
    base = training_key(config(), dataset(), "/w")
    assert training_key(config(), dataset(SHA_B), "/w") != base
    assert training_key(config(train={"learning_rate": 0.2}), dataset(), "/w") != base
    assert training_key(config(train={"run_name": "nightly-1"}), dataset(), "/w") != base
    assert training_key(config(seed=1), dataset(), "/w") != base
    assert training_key(config(tracking={"tracking_uri": "http://127.0.0.1:5000"}), dataset(), "/w") != base


def test_training_key_ignores_resume_and_later_stages():
    base = training_key(config(), dataset(), "/w")
    assert training_key(config(train={"resume": False}), dataset(), "/w") == base
    assert training_key(config(evaluate={"flip_tta": True}, export={"tolerance": 0.1}), dataset(), "/w") == base
    assert training_key(config(), dataset(data_dir="/other/place"), "/w") == base  # Same manifest content.


def test_evaluation_and_export_keys_follow_the_checkpoints():
    base = evaluation_key(config(), dataset(), training())
    assert evaluation_key(config(), dataset(), training("c2")) != base
    assert evaluation_key(config(evaluate={"checkpoints": "all"}), dataset(), training()) != base
    assert evaluation_key(config(export={"min_accuracy": 0.9}), dataset(), training()) == base
    exported = export_key(config(), dataset(), training(), evaluation())
    assert export_key(config(), dataset(), training("c2"), evaluation()) != exported
    assert export_key(config(), dataset(), training(), evaluation(0.6)) != exported
    assert export_key(config(export={"min_accuracy": 0.9}), dataset(), training(), evaluation()) == exported


# Code versions.


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """A copy of cifar/ that the code versions are computed from."""
    copy = tmp_path / "cifar"
    shutil.copytree(caching.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(caching, "PACKAGE_DIR", copy)
    return copy


def test_editing_a_stage_source_changes_that_stage_and_no_other(package_copy):
    before = {stage: code_version(stage) for stage in caching.STAGE_SOURCES}
    data_key_before = stage_key("data", config(), {"archive_sha256": SHA_A})
    with open(package_copy / "data" / "convert.py", "a") as handle:
        handle.write("\n# a change\n")
    after = {stage: code_version(stage) for stage in caching.STAGE_SOURCES}
    assert after["data"] != before["data"]
    assert {stage: after[stage] for stage in after if stage != "data"} == {
        stage: before[stage] for stage in before if stage != "data"}
    assert stage_key("data", config(), {"archive_sha256": SHA_A}) != data_key_before


def test_model_code_is_part_of_training_evaluation_and_export(package_copy):
    before = {stage: code_version(stage) for stage in caching.STAGE_SOURCES}
    with open(package_copy / "models.py", "a") as handle:
        handle.write("\n# a change\n")
    changed = {stage for stage in caching.STAGE_SOURCES if code_version(stage) != before[stage]}
    assert changed == {"train", "evaluate", "export"}


# Validation of cached results.


def test_fingerprint_notices_deleted_altered_and_added_files(tmp_path):
    directory = tmp_path / "out"
    directory.mkdir()
    (directory / "a.bin").write_bytes(b"1234")
    (directory / "b.bin").write_bytes(b"5678")
    original = fingerprint([directory])
    assert fingerprint([directory]) == original

    (directory / "a.bin").write_bytes(b"12345")  # Altered (size).
    assert fingerprint([directory]) != original
    (directory / "a.bin").write_bytes(b"1234")
    stat = (directory / "b.bin").stat()
    (directory / "b.bin").write_bytes(b"8765")  # Altered in place, same size: the mtime tells.
    os.utime(directory / "b.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert fingerprint([directory]) != original
    (directory / "c.bin").write_bytes(b"")  # Added.
    assert fingerprint([directory]) != fingerprint([directory / "a.bin", directory / "b.bin"], root=tmp_path)
    shutil.rmtree(directory)  # Deleted.
    assert fingerprint([directory]) != original


def test_a_cached_result_whose_files_changed_is_expired_not_returned(tmp_path):
    store = ResultStore(result_storage=LocalFileSystem(basepath=str(tmp_path / "results")), serializer=JSONSerializer())
    data_dir = tmp_path / "data" / "cifar10-x"
    data_dir.mkdir(parents=True)
    (data_dir / "manifest.json").write_text("{}")
    result = dataset(data_dir=str(data_dir)).model_copy(update={"fingerprint": fingerprint([data_dir])})
    store.write(obj=result, key="data-key")

    assert expire_if_invalid(store, "data-key", dataset_is_valid) is False
    assert store.exists("data-key") and store.read("data-key").result == result

    (data_dir / "manifest.json").unlink()
    assert expire_if_invalid(store, "data-key", dataset_is_valid) is True
    assert not store.exists("data-key")  # The engine sees no cached result and runs the task.
    assert expire_if_invalid(store, "missing-key", dataset_is_valid) is False
