"""The pipeline as a shared service: hostile and impossible requests, concurrent runs, kills in every stage.

Every test runs `python flows/pipeline.py` in real processes, as a terminal or a worker would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from cifar.config import make_config
from cifar.preflight import GIB, ImpossibleRequestError, check_request
from cifar.summary import PipelineSummary
from harness import REPO_ROOT
from harness.prefect import prefect_env

SMALL = ["--preset", "smoke", "--set", "train.model=tiny", "--set", "train.epochs=2", "--set", "train.batch_size=100",
         "--set", "data.validation_size=100", "--set", "data.expect_official_counts=false",
         "--set", "tracking.system_metrics=false"]  # fmt: skip
# In pipeline order, so each run gets one stage further than the last before it is killed.
KILL_POINTS = ["data.converted", "train.epoch", "evaluate.scored", "export.saved", "before:register",
               "register.registered"]  # fmt: skip


def command(archive: str, workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "flows/pipeline.py", "--source", archive, "--workdir", str(workdir), *SMALL, *extra]


def run(archive: str, workdir: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    """One pipeline run in a process group of its own (what a kill of "the whole group" reaches)."""
    environment = prefect_env(workdir.parent / "prefect-home", **env)
    return subprocess.run(command(archive, workdir, *extra), cwd=REPO_ROOT, capture_output=True, text=True,
                          env=environment, timeout=600, start_new_session=True)  # fmt: skip


def summary_of(workdir: Path) -> PipelineSummary:
    return PipelineSummary.read(workdir / "summary.json")


def shard_digests(data_dir: str) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in Path(data_dir).glob("*.tfrecord")}


def registry_versions(tracking_uri: str) -> dict[int, str]:
    """Registered version -> the export directory it was registered from."""
    client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    return {int(version.version): version.tags["export_dir"] for version in client.search_model_versions("")}


def leftovers(workdir: Path) -> list[str]:
    """Temp files and directories a finished workdir must not hold."""
    patterns = ("**/*.partial", "**/.tmp-*", "**/*.discarded-*", "**/_alembic_tmp_*")
    return sorted(str(path) for pattern in patterns for path in workdir.glob(pattern))


def assert_consistent(workdir: Path) -> PipelineSummary:
    """The end state every finished workdir must have: registry one-to-one with exports, a complete champion."""
    summary = summary_of(workdir)
    exports = sorted(str(path) for path in (workdir / "export" / "cifar10").iterdir() if path.name.isdigit())
    tracking_uri = summary.training.tracking_uri
    versions = registry_versions(tracking_uri)
    assert sorted(versions.values()) == exports and len(set(versions.values())) == len(versions)
    client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    champion = client.get_model_version_by_alias("cifar10", "champion")
    assert Path(versions[int(champion.version)], "saved_model.pb").is_file()
    assert leftovers(workdir) == []
    return summary


# Hostile and impossible requests: rejected before any work, one line, exit 2.


@pytest.mark.parametrize(
    "arguments, named",
    [
        (["--set", "export.model_name=../../x"], "export.model_name"),
        (["--set", "train.run_name=../escape"], "train.run_name"),
        (["--set", "tracking.experiment=a/b"], "tracking.experiment"),
        (["--source", "ftp://example.com/cifar.tar.gz"], "data.source"),
        (["--set", "tracking.tracking_uri=gopher://example.com"], "tracking.tracking_uri"),
        (["--set", "train.model=resnet2000000"], "train.model"),
        (["--set", "train.gpus=4"], "train.gpus"),
        (["--set", "train.model=resnet20", "--set", "train.batch_size=40000"], "train.batch_size"),
    ],
)
def test_a_hostile_or_impossible_request_fails_before_any_work(python_archive, tmp_path, capsys, arguments, named):
    # The command line's own entry point in this process (a refused request never reaches the supervisor, so
    # nothing differs from a new interpreter but the seconds of imports); test_cli.py runs one as a process.
    from flows.pipeline import main

    workdir = tmp_path / "workdir"
    argv = command(python_archive, workdir, *arguments)[2:]
    assert main(argv) == 2
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], stderr[-3000:]
    assert not (workdir / "data").exists()


def test_the_memory_estimate_refuses_what_cannot_fit_and_says_how_much():
    for preset in ("fast", "fast-sgd", "sprint"):
        check_request(make_config(preset), available=16 * GIB)  # The presets fit a 16 GiB machine.
    with pytest.raises(ImpossibleRequestError, match=r"train.batch_size 1024 with fast needs about \d+\.\d GiB"):
        check_request(make_config("fast-sgd"), available=2 * GIB)
    with pytest.raises(ImpossibleRequestError, match="larger than the 45,000 training examples"):
        check_request(make_config("default", {"train": {"batch_size": 45_001}}), available=1 << 50)


# Concurrency: any number of runs may share a workdir and a tracking store.


@pytest.fixture(scope="module")
def three_at_once(python_archive, tmp_path_factory) -> tuple[Path, list[tuple[subprocess.Popen, str]]]:
    """Three pipelines started at once on a new workdir: their workdir, processes and terminal output."""
    tmp_path = tmp_path_factory.mktemp("three-at-once")
    workdir = tmp_path / "workdir"
    # Two identical commands (one run folder, one export) and a third training into its own folder,
    # with MLflow's system metrics (whose monitor has lines of its own).
    extras = [(), (), ("--set", "train.run_name=b", "--set", "tracking.system_metrics=true")]
    processes = [subprocess.Popen(command(python_archive, workdir, *extra), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=prefect_env(tmp_path / "prefect-home", prepared=False))
                 for extra in extras]  # fmt: skip
    outputs = [process.communicate(timeout=600) for process in processes]
    return workdir, [(process, stdout + stderr) for process, (stdout, stderr) in zip(processes, outputs)]


@pytest.mark.slow
def test_three_pipelines_started_at_once_on_a_new_workdir_all_finish(three_at_once):
    workdir, finished = three_at_once
    for process, stderr in finished:
        assert process.returncode == 0, stderr[-4000:]
    summary = assert_consistent(workdir)
    database = Path(summary.training.tracking_uri.removeprefix("sqlite:///"))
    with sqlite3.connect(database) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    runs = mlflow.MlflowClient(tracking_uri=summary.training.tracking_uri).search_runs(["1"])
    assert sorted(run.info.run_name for run in runs)[0] == "b" and len(runs) == 2  # One run per training folder.
    assert [path.name for path in (workdir / "data").glob("cifar10-*")] == [Path(summary.data.data_dir).name]
    assert len(list((workdir / "data" / "snapshots").glob("*.json"))) == 2  # The base snapshot and `latest`.
    # Each run keeps its own summary beside the workdir's latest one.
    assert len(list(workdir.glob("runs/*/summary.json"))) == 2


MLFLOW_OWN_LINES = (  # What MLflow itself says in a run: database set-up, system metrics, registration.
    "INFO mlflow.store.db.utils: Creating initial MLflow database tables",
    "INFO mlflow.store.db.utils: Updating database tables",
    "INFO mlflow.system_metrics.system_metrics_monitor: Skip logging GPU metrics",
    "INFO mlflow.system_metrics.system_metrics_monitor: Started monitoring system metrics.",
    "INFO mlflow.pyfunc: Validating input example against model signature",
)


@pytest.mark.slow  # Reads the three pipelines of the module fixture.
def test_mlflows_own_lines_go_to_the_log_file_not_the_terminal(three_at_once):
    workdir, finished = three_at_once
    for _, terminal in finished:
        assert not [line for line in MLFLOW_OWN_LINES if line.split(": ")[1] in terminal], terminal[-4000:]
        assert "Downloading artifacts" not in terminal  # MLflow's progress bar: off (CIFAR_VERBOSE=1 shows it).
    logs = "".join(path.read_text() for path in (workdir / "logs").glob("pipeline-*.log"))
    # MLflow sets a database up only where the empty store new workdirs copy is made (once per machine and
    # MLflow: maybe in one of these runs, maybe earlier in the session); its other lines come every time.
    always = [line for line in MLFLOW_OWN_LINES if "mlflow.store.db.utils" not in line]
    assert [line for line in always if line in logs] == always


# Kills: SIGKILL of the whole process group inside each stage, then a re-run.


@pytest.mark.slow
def test_temporary_prefect_servers_started_at_once_on_a_new_prefect_home_do_not_collide(tmp_path):
    # Each run without a server starts a temporary one, and a server's start-up registers Prefect's block
    # types unless the memo store says it was done: started together on a new PREFECT_HOME, they inserted
    # the same rows and one exited (`UNIQUE constraint failed: block_type.slug`). The CLI does it first.
    env = prefect_env(tmp_path / "prefect-home", prepared=False)
    prepare = [sys.executable, "-c", "from flows.runtime import prepare_ephemeral_database as p; p()"]
    preparing = [subprocess.Popen(prepare, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    assert all(process.wait(timeout=300) == 0 for process in preparing), [p.stderr.read() for p in preparing]
    home = tmp_path / "prefect-home"
    memo, prepared_for = home / "memo_store.toml", home / ".prefect.db.prepared"
    assert "block_auto_registration" in memo.read_text() and prepared_for.read_text().startswith("prefect==")
    installed = prepared_for.read_text()
    prepared_for.write_text("prefect==3.0.0\n")  # As after an upgrade: new migrations, maybe new block types.
    assert subprocess.run(prepare, cwd=REPO_ROOT, env=env, timeout=300).returncode == 0
    assert prepared_for.read_text() == installed
    recorded = memo.stat().st_mtime_ns

    script = tmp_path / "trivial.py"  # A server's start-up after it reads the memo and skips the registration.
    script.write_text("from prefect import flow\n\n@flow\ndef trivial():\n    return 1\n\ntrivial()\n")
    flow_run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert flow_run.returncode == 0, flow_run.stderr[-3000:]
    assert memo.stat().st_mtime_ns == recorded  # No server registered the block types again.


@pytest.mark.slow
def test_a_run_killed_inside_each_stage_in_turn_ends_as_a_clean_run_does(python_archive, tmp_path, three_at_once):
    clean_workdir, finished = three_at_once  # Clean runs of the same command (the first two).
    assert all(process.returncode == 0 for process, _ in finished)
    clean = assert_consistent(clean_workdir)

    workdir = tmp_path / "killed" / "workdir"
    for point in KILL_POINTS:
        killed = run(python_archive, workdir, CIFAR_KILL_AT=point)
        assert killed.returncode == -signal.SIGKILL, f"{point}: {killed.stderr[-3000:]}"
    final = run(python_archive, workdir)
    assert final.returncode == 0, final.stderr[-4000:]
    summary = assert_consistent(workdir)

    assert shard_digests(summary.data.data_dir) == shard_digests(clean.data.data_dir)
    assert Path(summary.data.data_dir).name == Path(clean.data.data_dir).name
    training = summary.training
    client = mlflow.MlflowClient(tracking_uri=training.tracking_uri)
    for metric in ("loss", "accuracy", "val_accuracy"):  # Each epoch's metrics once, none lost.
        assert sorted(entry.step for entry in client.get_metric_history(training.mlflow_run_id, metric)) == [1, 2]
    assert json.loads(Path(training.run_dir, "history.json").read_text())["epoch"] == [1, 2]
    promotion = summary.promotion
    assert summary.export.version == 1 and promotion.registered_model_version == 1 and promotion.champion

    # Without Prefect's records (a new worker machine, say) the library finds every stage's work again.
    shutil.rmtree(workdir / "prefect-results")
    again = run(python_archive, workdir)
    assert again.returncode == 0, again.stderr[-4000:]
    assert summary_of(workdir).task_states == {
        "download": "Completed",
        "snapshot": "Completed",
        "prepare": "Reused",
        "validate-data": "Completed",
        "train": "Reused",
        "evaluate": "Reused",
        "export": "Reused",
        "register": "Reused",
    }
    assert assert_consistent(workdir).promotion.registered_model_version == 1


@pytest.mark.slow
def test_a_pipeline_process_killed_alone_leaves_no_process_behind(python_archive, tmp_path):
    """As the OOM killer would: only the pipeline's own process dies; its supervisor ends the rest."""
    workdir = tmp_path / "workdir"
    supervisor = subprocess.Popen(command(python_archive, workdir), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=prefect_env(tmp_path / "prefect-home"),
                                  start_new_session=True)  # fmt: skip
    deadline, descendants = time.monotonic() + 120, []
    while time.monotonic() < deadline:  # Until the pipeline process has started the ephemeral server.
        descendants = psutil.Process(supervisor.pid).children(recursive=True)
        if len(descendants) >= 2 and (workdir / "data").exists():
            break
        time.sleep(0.2)
    descendants = psutil.Process(supervisor.pid).children(recursive=True)
    # The supervisor's children: the temporary Prefect server (uvicorn) and the pipeline process (its fork).
    server, pipeline = sorted(psutil.Process(supervisor.pid).children(), key=lambda p: "uvicorn" not in p.cmdline())
    assert "uvicorn" in server.cmdline() and "flows/pipeline.py" in pipeline.cmdline()
    pipeline.send_signal(signal.SIGKILL)
    _, stderr = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 1 and "killed by SIGKILL" in stderr.strip().splitlines()[-1]
    assert not [process for process in descendants if process.is_running() and process.status() != "zombie"]


def test_a_workdir_outside_the_workers_root_is_refused(python_archive, tmp_path, capsys, monkeypatch):
    from flows.pipeline import main

    root, outside = tmp_path / "allowed", tmp_path / "elsewhere" / "workdir"
    monkeypatch.setenv("CIFAR_WORKDIR_ROOT", str(root))
    assert main(command(python_archive, outside)[2:]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: workdir {outside} is outside CIFAR_WORKDIR_ROOT={root}: choose a workdir inside it"
    ]
    assert not outside.exists()


@pytest.mark.slow
def test_a_store_left_half_migrated_is_repaired_without_losing_runs(tmp_path, monkeypatch):
    from cifar import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.mlflow_client(uri).create_run(tracking.ensure_experiment(uri, tmp_path, "cifar10")).info.run_id
    with sqlite3.connect(tmp_path / "mlflow.db") as connection:  # What a migration killed halfway leaves.
        connection.execute("CREATE TABLE _alembic_tmp_model_versions AS SELECT * FROM model_versions")
        connection.execute("CREATE TABLE _alembic_tmp_runs AS SELECT * FROM runs")
        connection.execute("DROP TABLE runs")
    monkeypatch.setattr(tracking, "_READY_STORES", set())  # As a new process finds it.
    assert tracking.mlflow_client(uri).get_run(run_id).info.run_id == run_id
    with sqlite3.connect(tmp_path / "mlflow.db") as connection:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "runs" in tables and not [name for name in tables if name.startswith("_alembic_tmp_")]


@pytest.mark.slow
def test_sigterm_to_the_command_during_training_saves_and_the_same_command_resumes(python_archive, tmp_path):
    """`kill PID` of the command mid-training (sent at a known point by the run itself, CIFAR_TERM_AT): the
    supervisor forwards it, training saves mid-epoch and exits 143 with one line, the flow run ends FAILED,
    nothing is left running; the same command continues from the next step, each epoch logged once."""
    workdir, home = tmp_path / "workdir", tmp_path / "prefect-home"
    # 4 steps of 100 images per epoch; float32 spares the measurement of `train.precision: auto`.
    three_epochs = ("--until", "train", "--set", "train.epochs=3", "--set", "train.precision=float32")
    supervisor = subprocess.Popen(command(python_archive, workdir, *three_epochs), cwd=REPO_ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                  env=prefect_env(home, CIFAR_TERM_AT="train.reported:1"))  # fmt: skip
    started: dict[int, psutil.Process] = {}
    while supervisor.poll() is None:  # Every process the run starts, to check that none outlives it.
        with contextlib.suppress(psutil.NoSuchProcess):
            started |= {process.pid: process for process in psutil.Process(supervisor.pid).children(recursive=True)}
        time.sleep(0.1)
    _, stderr = supervisor.communicate()
    assert supervisor.returncode == 128 + signal.SIGTERM, stderr[-4000:]
    stopped = "stopped: training stopped by SIGTERM and saved after step 2 of 4 in epoch 2; run the same command again"
    assert [line for line in stderr.splitlines() if line.startswith(stopped)], stderr[-4000:]
    assert len(started) >= 2 and not [p for p in started.values() if p.is_running() and p.status() != "zombie"]
    with sqlite3.connect(home / "prefect.db") as connection:
        assert connection.execute("SELECT state_type FROM flow_run").fetchall() == [("FAILED",)]

    resumed = run(python_archive, workdir, *three_epochs)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    training = summary_of(workdir).training
    client = mlflow.MlflowClient(tracking_uri=training.tracking_uri)
    for metric in ("loss", "accuracy", "val_accuracy"):
        assert sorted(entry.step for entry in client.get_metric_history(training.mlflow_run_id, metric)) == [1, 2, 3]
    assert client.get_run(training.mlflow_run_id).info.status == "FINISHED"
    index = json.loads(Path(training.checkpoint_dir, "index.json").read_text())
    assert index["partial"] is None and [entry["epoch"] for entry in index["entries"]][-1] == 3


def test_a_new_store_copied_from_the_empty_one_is_the_store_mlflow_would_have_made(tmp_path, monkeypatch):
    from cifar import tracking

    def schema_and_experiments(path: Path) -> tuple[set, list]:
        def clauses(sql: str | None) -> tuple[str, ...]:  # MLflow's own migrations order CHECKs either way.
            return tuple(sorted(line.strip().rstrip(",").strip() for line in (sql or "").splitlines()))

        with contextlib.closing(sqlite3.connect(path)) as connection:
            rows = connection.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
            schema = {(kind, name, clauses(sql)) for kind, name, sql in rows}
            revision = connection.execute("SELECT version_num FROM alembic_version").fetchall()
            experiments = connection.execute("SELECT experiment_id, name, artifact_location FROM experiments")
            return schema | {("revision", *revision)}, experiments.fetchall()

    monkeypatch.setenv("CIFAR_CACHE_DIR", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path / 'first' / 'mlflow.db'}"
    (tmp_path / "first").mkdir()
    monkeypatch.chdir(tmp_path / "first")  # Where MLflow puts the Default experiment's artifacts: ./mlruns.
    tracking.mlflow_client(uri)  # Makes the cache's empty store, then copies it.
    (template,) = (tmp_path / "cache" / "mlflow-stores").glob("empty-*.db")
    assert schema_and_experiments(template)[1] == []  # No Default experiment naming where it was made.

    migrated = tmp_path / "migrated"
    migrated.mkdir()
    monkeypatch.chdir(migrated)
    import mlflow

    mlflow.MlflowClient(tracking_uri=f"sqlite:///{migrated / 'mlflow.db'}").search_experiments()  # MLflow alone.
    copied = tmp_path / "copied"
    copied.mkdir()
    uri = f"sqlite:///{copied / 'mlflow.db'}"
    assert tracking.ensure_experiment(uri, copied, "cifar10") == "1"  # As in a migrated store: 0 is Default.
    copied_schema, copied_experiments = schema_and_experiments(copied / "mlflow.db")
    migrated_schema, migrated_experiments = schema_and_experiments(migrated / "mlflow.db")
    assert copied_schema == migrated_schema
    assert copied_experiments[0] == (0, "Default", str(migrated / "mlruns" / "0"))  # This store's own.
    assert migrated_experiments == [(0, "Default", str(migrated / "mlruns" / "0"))]
    assert not list(copied.glob(".*.partial"))
