"""`python flows/pipeline.py` with no server (Prefect's ephemeral mode): data stage, caching, bad checksums."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cifar.io import file_digest
from cifar.reuse import code_version
from cifar.summary import PipelineSummary
from harness import REPO_ROOT
from harness.prefect import prefect_env

DATA_ONLY = ["--until", "data", "--set", "data.expect_official_counts=false", "--set", "data.validation_size=100"]


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prefect-home")


def run_pipeline(prefect_home: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """Runs the pipeline script as a user would, with an isolated PREFECT_HOME and no PREFECT_API_URL."""
    return subprocess.run(
        [sys.executable, "flows/pipeline.py", *argv],
        cwd=REPO_ROOT,
        env=prefect_env(prefect_home, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def code_versions() -> dict[str, str]:
    return {"prepare": code_version("data")}


def expected_cached(before: dict[str, str]) -> dict[str, str]:
    """The tasks that must end Cached: all whose `cifar/` code was not edited since `before`.

    (An edit gives that task a new key, so it rightly runs again; this only matters while the code
    is being changed under a running test.)
    """
    return {name: "Cached" for name, version in code_versions().items() if version == before[name]}


def task_states(workdir: Path, names) -> dict[str, str]:
    states = PipelineSummary.read(workdir / "summary.json").task_states
    return {name: states[name] for name in names}


@pytest.mark.slow
def test_data_stage_writes_the_summary_then_is_cached(prefect_home, python_archive, tmp_path):
    workdir = tmp_path / "workdir"
    versions = code_versions()
    argv = ["--source", python_archive, "--sha256", file_digest(python_archive), "--workdir", str(workdir), *DATA_ONLY]

    # The stages' loggers also go to Prefect's API, as on a worker (prefect.yaml's pool).
    first = run_pipeline(prefect_home, *argv, PREFECT_LOGGING_EXTRA_LOGGERS="cifar,tasks")
    assert first.returncode == 0, first.stderr[-4000:]
    summary = PipelineSummary.read(workdir / "summary.json")
    data = summary.data
    assert Path(data.manifest_path) == Path(data.data_dir) / "manifest.json"
    assert Path(data.manifest_path).is_file()
    assert data.counts == {"train": 400, "validation": 100, "test": 200}
    assert summary.task_states == {
        "download": "Completed",
        "snapshot": "Completed",
        "prepare": "Completed",
        "validate-data": "Completed",  # The gate runs every time: the champion may have changed.
    }
    assert data.snapshot and summary.validation.passed
    assert "cifar pipeline done" in first.stdout and data.data_dir in first.stdout
    # The data stage logs from a thread too (the archive's analysis): its lines belong to the flow run.
    assert "without a flow run id" not in first.stderr, first.stderr[-4000:]

    second = run_pipeline(prefect_home, *argv)
    assert second.returncode == 0, second.stderr[-4000:]
    expected = expected_cached(versions)
    assert task_states(workdir, expected) == expected

    # A shard deleted behind the cache's back: the stale result is not returned, the data is rebuilt.
    shard = next(Path(data.data_dir).glob("train-*.tfrecord"))
    shard.unlink()
    third = run_pipeline(prefect_home, *argv)
    assert third.returncode == 0, third.stderr[-4000:]
    assert task_states(workdir, ["prepare"]) == {"prepare": "Completed"}
    assert shard.is_file()

    # --refresh recomputes even though everything is in place.
    refreshed = run_pipeline(prefect_home, *argv, "--refresh")
    assert refreshed.returncode == 0, refreshed.stderr[-4000:]
    assert PipelineSummary.read(workdir / "summary.json").task_states == {
        "download": "Completed",
        "snapshot": "Completed",
        "prepare": "Completed",
        "validate-data": "Completed",
    }


@pytest.mark.slow
def test_wrong_checksum_fails_naming_both_digests_and_leaves_no_data(prefect_home, python_archive, tmp_path):
    workdir = tmp_path / "workdir"
    wrong, actual = "0" * 64, file_digest(python_archive)

    result = run_pipeline(
        prefect_home, "--source", python_archive, "--sha256", wrong, "--workdir", str(workdir), *DATA_ONLY
    )

    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: ChecksumMismatchError"), result.stderr[-4000:]
    assert wrong in errors[0] and actual in errors[0]
    assert not (workdir / "data").exists() or not any((workdir / "data").iterdir())
    assert not (workdir / "summary.json").exists()


@pytest.mark.slow
def test_a_sweep_whose_point_fails_marks_its_mlflow_parent_failed(prefect_home, tmp_path):
    workdir, tracking_uri = tmp_path / "workdir", f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = (
        "import sys\n"
        "from cifar.config import make_config\n"
        "from flows.sweep import sweep\n"
        f"config = make_config('smoke', {{'data': {{'source': {str(tmp_path / 'missing.tar.gz')!r}}}, "
        f"'tracking': {{'tracking_uri': {tracking_uri!r}}}}})\n"
        f"sweep(config=config, models=['tiny'], learning_rates=[0.05], workdir={str(workdir)!r}, until='train')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=prefect_env(prefect_home),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode != 0 and "missing.tar.gz" in result.stderr
    import mlflow

    [parent] = mlflow.MlflowClient(tracking_uri=tracking_uri).search_runs(["1"], "tags.`cifar.sweep` = 'parent'")
    assert parent.info.status == "FAILED" and "tiny-lr0.05" in parent.data.tags["failure"]
