"""The reuse rule end to end: `python flows/pipeline.py` in a copy of the project, as a user runs it.

Editing a module a stage executes recomputes that stage and the ones after it (a new training run
for training), and an unchanged re-run reuses everything. (A run killed between export and
registration, and in every other stage: tests/test_reliability.py.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from cifar.summary import PipelineSummary
from harness import REPO_ROOT
from harness.prefect import prefect_env

pytestmark = pytest.mark.slow

SMALL = [
    "--preset",
    "smoke",
    "--set",
    "train.model=tiny",
    "--set",
    "train.epochs=1",
    "--set",
    "train.batch_size=100",
    "--set",
    "data.validation_size=100",
    "--set",
    "data.expect_official_counts=false",
    "--set",
    "tracking.system_metrics=false",
]


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of the project's code, free to edit (the pipeline runs the copy: flows/ puts it first on sys.path)."""
    copy = tmp_path / "project"
    for name in ("cifar", "tasks", "flows"):
        shutil.copytree(REPO_ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def run(project: Path, workdir: Path, archive: str, **env: str) -> subprocess.CompletedProcess:
    """One pipeline run in its own process group, as a terminal would start it."""
    return subprocess.run(
        [sys.executable, "flows/pipeline.py", "--source", archive, "--workdir", str(workdir), *SMALL],
        cwd=project,
        env=prefect_env(workdir.parent / "prefect-home", **env),
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )


def summary_of(workdir: Path) -> PipelineSummary:
    return PipelineSummary.read(workdir / "summary.json")


def test_editing_the_optimizer_trains_a_new_run_while_an_unchanged_rerun_reuses_everything(
    project, python_archive, tmp_path
):
    workdir = tmp_path / "workdir"
    first = run(project, workdir, python_archive)
    assert first.returncode == 0, first.stderr[-4000:]
    before = summary_of(workdir)
    assert before.config.train.model == "tiny" and before.config.preset == "smoke"
    assert before.config.train.epochs == 1 and before.config.train.steps_per_epoch == 60

    # The data key logged to MLflow is the key in the data directory's name.
    client = mlflow.MlflowClient(tracking_uri=before.training.tracking_uri)
    logged_key = client.get_run(before.training.mlflow_run_id).data.tags["derived.data_key"]
    assert Path(before.data.data_dir).name == f"cifar10-{logged_key}" and before.stage_keys["data"] == logged_key

    started = time.monotonic()
    unchanged = run(project, workdir, python_archive)
    seconds = time.monotonic() - started
    assert unchanged.returncode == 0, unchanged.stderr[-4000:]
    again = summary_of(workdir)
    print(f"unchanged re-run: {seconds:.1f} s")  # Reported, not asserted (no timing assertions in tests).
    assert again.task_states == {
        "download": "Completed",
        "snapshot": "Completed",  # Not cached: `latest` moves when data is ingested.
        "prepare": "Cached",
        "validate-data": "Completed",  # Every run: the champion, its reference, may have changed.
        "train": "Cached",
        "evaluate": "Cached",
        "export": "Cached",
        "register": "Cached",
    }
    assert again.stage_keys == before.stage_keys and again.export.export_dir == before.export.export_dir

    with open(project / "cifar" / "optimizers.py", "a") as handle:
        handle.write("\n# An edit that changes no behaviour, but the code's version all the same.\n")
    edited = run(project, workdir, python_archive)
    assert edited.returncode == 0, edited.stderr[-4000:]
    after = summary_of(workdir)
    assert after.task_states["prepare"] == "Cached" and after.data.data_dir == before.data.data_dir
    assert {name: after.task_states[name] for name in ("train", "evaluate", "export", "register")} == {
        "train": "Completed",
        "evaluate": "Completed",
        "export": "Completed",
        "register": "Completed",
    }
    assert after.training.run_name != before.training.run_name
    assert after.training.mlflow_run_id != before.training.mlflow_run_id
    assert Path(after.training.checkpoint_dir, "epoch-0001.keras").is_file()
    assert Path(before.training.checkpoint_dir, "epoch-0001.keras").is_file()  # The old run is kept, not resumed.
    assert after.export.version == before.export.version + 1
    assert after.promotion.registered_model_version == before.promotion.registered_model_version + 1
