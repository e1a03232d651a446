"""The reuse rule: stage keys change exactly when a stage's inputs, settings or code change."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from prefect.filesystems import LocalFileSystem
from prefect.results import ResultStore
from prefect.serializers import JSONSerializer

from cifar import reuse
from cifar.config import make_config
from cifar.data.prepare import prepare_data, reusable_manifest
from cifar.reuse import (
    code_version,
    data_key,
    evaluation_key,
    export_key,
    finished_training_key,
    registration_key,
    training_key,
)
from tasks.caching import expire_if_invalid

SHA_A, SHA_B = "a" * 64, "b" * 64


def config(**sections):
    return make_config("smoke", sections)


# The data stage.


def test_data_key_follows_the_archive_content_and_the_shard_settings():
    base = data_key(config().data, SHA_A)
    assert data_key(config().data, SHA_A) == base  # Deterministic.
    assert data_key(config().data, SHA_B) != base
    assert data_key(config(data={"validation_size": 100}).data, SHA_A) != base
    assert data_key(config(data={"train_shards": 4}).data, SHA_A) != base


@pytest.mark.parametrize(
    "irrelevant",
    [
        {"evaluate": {"batch_size": 100, "flip_tta": True}},
        {"train": {"epochs": 9, "model": "tiny"}},
        {"export": {"min_accuracy": 0.9}},
        {"seed": 3},
        {"data": {"source": "/elsewhere/same-bytes.tar.gz", "download_retries": 9, "expect_official_counts": False}},
    ],
)
def test_data_key_ignores_what_cannot_change_the_shards(irrelevant):
    assert data_key(config(**irrelevant).data, SHA_A) == data_key(config().data, SHA_A)


# Training and after.


def test_training_key_follows_the_data_the_training_settings_and_the_seed():
    base = training_key(config(), "data-a")
    assert training_key(config(), "data-b") != base
    assert training_key(config(train={"learning_rate": 0.2}), "data-a") != base
    assert training_key(config(seed=1), "data-a") != base


def test_training_key_ignores_resume_the_folder_name_and_later_stages():
    base = training_key(config(), "data-a")
    assert training_key(config(train={"resume": False, "run_name": "nightly-1"}), "data-a") == base
    assert training_key(config(evaluate={"flip_tta": True}, export={"min_improvement": 0.1}), "data-a") == base
    assert training_key(config(tracking={"tracking_uri": "http://127.0.0.1:5000"}), "data-a") == base


def test_a_named_run_is_looked_up_in_its_own_folder_only():
    # Same training, so the same training key; but a named run is its folder, and the cache must not
    # hand it the unnamed run's folder (the library would train into the named folder).
    unnamed = finished_training_key(config(), "data-a")
    named = finished_training_key(config(train={"run_name": "b"}), "data-a")
    assert unnamed == training_key(config(), "data-a")
    assert named != unnamed and named.startswith(unnamed)
    assert finished_training_key(config(train={"run_name": "b", "resume": False}), "data-a") == named
    assert finished_training_key(config(train={"run_name": "c"}), "data-a") != named


def test_later_keys_follow_what_they_read():
    base = evaluation_key(config(), "data-a", "index-1")
    assert evaluation_key(config(), "data-a", "index-2") != base  # Retrained checkpoints.
    assert evaluation_key(config(), "data-b", "index-1") != base
    assert evaluation_key(config(evaluate={"checkpoints": "all"}), "data-a", "index-1") != base
    assert evaluation_key(config(export={"min_accuracy": 0.9}), "data-a", "index-1") == base
    exported = export_key(config(), "evaluation-1")
    assert export_key(config(), "evaluation-2") != exported
    assert export_key(config(export={"model_name": "other"}), "evaluation-1") != exported
    assert export_key(config(export={"min_accuracy": 0.9}), "evaluation-1") == exported
    registered = registration_key(config(), "export-1", "sqlite:///a.db")
    assert registration_key(config(), "export-2", "sqlite:///a.db") != registered
    assert registration_key(config(), "export-1", "sqlite:///b.db") != registered
    assert registration_key(config(export={"min_improvement": 0.1}), "export-1", "sqlite:///a.db") != registered


# Code versions, derived from the import graph.


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """A copy of cifar/ that the code versions are computed from."""
    copy = tmp_path / "cifar"
    shutil.copytree(reuse.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(reuse, "PACKAGE_DIR", copy)
    return copy


def versions() -> dict[str, str]:
    return {stage: code_version(stage) for stage in reuse.STAGE_MODULES}


def test_every_module_a_stage_imports_is_part_of_its_code():
    training = reuse.module_closure("cifar.train")
    for module in (
        "cifar.optimizers",
        "cifar.models",
        "cifar.layers",
        "cifar.callbacks",
        "cifar.checkpoints",
        "cifar.input_pipeline",
        "cifar.data.manifest",
        "cifar.config",
        "cifar",
    ):
        assert module in training
    assert "cifar.data.convert" not in training
    assert "cifar.input_pipeline" in reuse.module_closure("cifar.evaluate")  # Imported inside a function.


def test_the_imports_of_a_package_are_followed_into_its_modules():
    batch_prediction = reuse.module_closure("cifar.predict")  # A package whose __init__ re-exports its modules.
    for module in ("sources", "model", "job", "scoring", "result", "tracking"):
        assert f"cifar.predict.{module}" in batch_prediction
    assert "cifar.monitoring" in batch_prediction  # Imported by a module of the package, not by its __init__.


def test_a_parse_another_thread_raced_is_parsed_again(monkeypatch):
    # CPython 3.11 (python/cpython#106905): a parse in another thread at the same moment can make
    # ast.parse raise SystemError; a task's cache key then failed. The key is the same as undisturbed.
    expected = reuse.code_files("train")
    real_parse, raced = reuse.ast.parse, []

    def parse_raced_once(source, *args, **kwargs):
        if not raced:
            raced.append(True)
            raise SystemError("AST constructor recursion depth mismatch (before=78, after=94)")
        return real_parse(source, *args, **kwargs)

    monkeypatch.setattr(reuse.ast, "parse", parse_raced_once)
    reuse._imports_in_source.cache_clear()  # parses are remembered by content: this one must happen
    raced_files = reuse.code_files("train")
    monkeypatch.undo()  # before asserting: pytest parses source to report a failure
    assert raced_files == expected and raced == [True]


def test_editing_the_optimizer_changes_training_and_nothing_before_it(package_copy):
    before = versions()
    with open(package_copy / "optimizers.py", "a") as handle:
        handle.write("\n# a change\n")
    after = versions()
    assert after["train"] != before["train"]
    assert after["data"] == before["data"] and after["download"] == before["download"]


@pytest.mark.slow
def test_editing_the_converter_changes_the_data_stage_only(package_copy):
    before = versions()
    with open(package_copy / "data" / "convert.py", "a") as handle:
        handle.write("\n# a change\n")
    changed = {stage for stage, version in versions().items() if version != before[stage]}
    assert changed == {"data"}


def test_a_module_newly_imported_by_a_stage_joins_its_code(package_copy):
    (package_copy / "extra.py").write_text("VALUE = 1\n")
    assert "cifar.extra" not in reuse.module_closure("cifar.optimizers")
    with open(package_copy / "optimizers.py", "a") as handle:
        handle.write("\nfrom cifar import extra  # noqa: E402,F401\n")
    assert "cifar.extra" in reuse.module_closure("cifar.train")
    before = code_version("train")
    (package_copy / "extra.py").write_text("VALUE = 2\n")
    assert code_version("train") != before


# Prefect's cache only returns what the library would reuse.


def test_a_cached_result_the_library_would_not_reuse_is_expired(python_archive, tmp_path):
    store = ResultStore(result_storage=LocalFileSystem(basepath=str(tmp_path / "results")), serializer=JSONSerializer())
    data = make_config(
        "default", {"data": {"source": python_archive, "validation_size": 100, "expect_official_counts": False}}
    ).data
    result = prepare_data(data, tmp_path / "workdir")
    store.write(obj=result, key="prepare-key")

    def still_valid(cached) -> bool:
        return reusable_manifest(cached.data_dir, cached.key) is not None

    assert expire_if_invalid(store, "prepare-key", still_valid) is False
    assert store.read("prepare-key").result == result

    next(Path(result.data_dir).glob("train-*")).unlink()
    assert expire_if_invalid(store, "prepare-key", still_valid) is True
    assert not store.exists("prepare-key")  # The engine sees no cached result and runs the task.
    assert expire_if_invalid(store, "missing-key", still_valid) is False
