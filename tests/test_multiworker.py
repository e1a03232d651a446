"""One training over several processes on 127.0.0.1: rendezvous through the Prefect API, gang start, a lost worker.

The rendezvous tests run the chief and the workers' sides in threads against a real Prefect server (the
workers' flow runs are placed on a pool nobody serves); the last test runs `python flows/pipeline.py
--set train.workers=2` as a user would, kills its worker after an epoch and runs the command again.
"""

from __future__ import annotations

import contextvars
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import pytest

from cifar.cluster import ClusterSpec, GangStartError, ResumePoint
from cifar.config import make_config
from cifar.summary import PipelineSummary
from harness import REPO_ROOT
from harness.prefect import prefect_env
from harness.servers import start_prefect_server

IDLE_POOL = "nobody-serves-this"


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """A Prefect server with the training-worker deployment on a pool no worker serves; its API as the default."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server = start_prefect_server(tmp_path_factory.mktemp("prefect"))
    with server, temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        with get_client(sync_client=True) as client:
            client.create_work_pool(WorkPoolCreate(name=IDLE_POOL, type="process"))
            flow_id = client.create_flow_from_name("cifar-train-worker")
            client.create_deployment(flow_id=flow_id, name="worker", work_pool_name=IDLE_POOL, entrypoint="x.py:f")
        yield server.api_url


def job_config(workers: int, timeout: float):
    return make_config("smoke", {"train": {"workers": workers, "gang_timeout_seconds": timeout}})


def placed_tickets(job: str, workers: int, timeout: float = 30.0) -> list:
    """The tickets of the flow runs the chief placed for `job` (what each worker's flow run gets)."""
    from prefect.client.orchestration import get_client

    from tasks.cluster import JobTicket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            tickets = [JobTicket.model_validate(run.parameters["job"]) for run in client.read_flow_runs()]
        tickets = sorted((ticket for ticket in tickets if ticket.job == job), key=lambda ticket: ticket.index)
        if len(tickets) == workers - 1:
            return tickets
        time.sleep(0.2)
    raise AssertionError(f"the chief placed no {workers - 1} flow runs for job {job}")


def in_thread(target, *args) -> threading.Thread:
    """A started thread that sees this one's Prefect settings (a context variable: the test server)."""
    thread = threading.Thread(target=contextvars.copy_context().run, args=(target, *args))
    thread.start()
    return thread


def run_job(config, digests: dict[int, str | None]) -> tuple[dict[int, object], object]:
    """The chief in this thread, each worker with a digest in its own; None: that worker never joins.
    Returns what each side's `join` returned or raised, and the chief's rendezvous."""
    from tasks.cluster import PrefectRendezvous

    chief = PrefectRendezvous.chief(config, "./workdir")
    outcomes: dict[int, object] = {}

    def join(rendezvous, index: int, digest: str, offer) -> None:
        try:
            outcomes[index] = rendezvous.join(digest, offer)
        except GangStartError as error:
            outcomes[index] = error

    def workers() -> None:
        for ticket in placed_tickets(chief.ticket.job, config.train.workers):
            if digests[ticket.index] is not None:
                worker = PrefectRendezvous(config, "./workdir", ticket)
                in_thread(join, worker, ticket.index, digests[ticket.index], None)

    placing = in_thread(workers)
    join(chief, 0, "same", ResumePoint(epoch=2))
    placing.join()
    deadline = time.monotonic() + 30
    while len(outcomes) < 1 + sum(digest is not None for digest in digests.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return outcomes, chief


@pytest.mark.slow
def test_the_chief_hands_every_worker_the_same_cluster_or_refuses_different_shards(prefect_api):
    outcomes, chief = run_job(job_config(3, 60), {1: "same", 2: "same"})
    assert isinstance(outcomes[0], ClusterSpec) and outcomes[0] == outcomes[1] == outcomes[2]
    spec = outcomes[0]
    assert len(set(spec.workers)) == 3 and all(address.startswith("127.0.0.1:") for address in spec.workers)
    assert spec.resume.epoch == 2  # Where the chief's run stands, handed to every worker.
    assert json.loads(spec.tf_config(1)) == {
        "cluster": {"worker": spec.workers},
        "task": {"type": "worker", "index": 1},
    }
    chief.close()  # The job's variables are gone.
    from prefect.variables import Variable

    assert Variable.get(f"cifar-job-{chief.ticket.job}-cluster") is None

    outcomes, _ = run_job(job_config(3, 60), {1: "same", 2: "other"})
    messages = {str(outcome) for outcome in outcomes.values()}
    assert len(messages) == 1 and all(isinstance(outcome, GangStartError) for outcome in outcomes.values())
    assert re.search(r"worker 2 \(.+ on .+\) prepared shards that differ from the chief's", messages.pop())


@pytest.mark.slow
def test_a_worker_that_never_joins_ends_every_process_naming_it_and_its_flow_run_is_cancelled(prefect_api):
    from prefect.client.orchestration import get_client

    started = time.monotonic()
    outcomes, chief = run_job(job_config(3, 3), {1: "same", 2: None})
    assert time.monotonic() - started < 30
    message = str(outcomes[0])
    assert isinstance(outcomes[0], GangStartError) and str(outcomes[1]) == message  # The joined worker says the same.
    assert re.search(r"1 of 2 workers did not join: worker 2 \(flow run .+-worker-2: Scheduled\) within 3 s", message)
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(chief.placed[2]).state
    assert state.name == "Cancelled" and "did not join" in state.message


# The whole feature as a user runs it: a local pool, a worker killed mid-training, the same command again.
SMALL = ["--preset", "smoke", "--set", "train.model=tiny", "--set", "train.epochs=3", "--set", "train.batch_size=100",
         "--set", "data.validation_size=100", "--set", "data.expect_official_counts=false",
         "--set", "tracking.system_metrics=false", "--set", "train.precision=float32",
         "--set", "train.workers=2", "--until", "train"]  # fmt: skip


def pipeline(archive: str, workdir: Path, **env: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "flows/pipeline.py", "--source", archive, "--workdir", str(workdir), *SMALL]
    environment = prefect_env(workdir.parent / "prefect-home", **env)
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env=environment, timeout=600)


def clock(stamp: str) -> float:
    """Seconds since midnight of a Prefect log line's `HH:MM:SS.mmm`."""
    hours, minutes, seconds = stamp.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def worker_log(workdir: Path) -> str:
    return max((workdir / "logs").glob("pool-worker-0-*.log"), key=lambda path: path.stat().st_mtime).read_text()


@pytest.mark.slow
def test_two_workers_train_one_run_a_killed_worker_stops_the_job_and_the_same_command_resumes(python_archive, tmp_path):
    workdir = tmp_path / "workdir"
    killed = pipeline(python_archive, workdir, CIFAR_KILL_AT="train.worker-reported:1")  # Worker 1, after epoch 1.
    assert killed.returncode == 1, killed.stderr[-4000:]
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.match(
        r"error: WorkerLostError: training job lost worker 1 \(127\.0\.0\.1:\d+\)", errors[0]
    )
    assert "as crashed" in worker_log(workdir)  # The killed worker's flow run: CRASHED; the chief's: FAILED.
    assert "Finished in state Failed" in killed.stderr
    # The chief failed within TensorFlow's coordination-service heartbeat timeout (10 s) of the kill: no hang.
    killed_at = clock(re.search(r"^(\S+) .*Process exited with status code: -9", worker_log(workdir), re.M).group(1))
    failed_at = clock(re.search(r"^(\S+) .*Encountered exception during execution", killed.stderr, re.M).group(1))
    assert 0 < failed_at - killed_at < 30

    resumed = pipeline(python_archive, workdir)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert re.search(r"resuming tiny-\w+ after epoch 1", worker_log(workdir))  # From the chief's checkpoint (MLflow).
    training = PipelineSummary.read(workdir / "summary.json").training
    client = mlflow.MlflowClient(tracking_uri=training.tracking_uri)
    assert len(client.search_runs(["1"])) == 1  # One MLflow run, only the chief's.
    for metric in ("loss", "val_accuracy"):
        assert sorted(entry.step for entry in client.get_metric_history(training.mlflow_run_id, metric)) == [1, 2, 3]
    # Both workers stepped together: the worker's losses are the chief's.
    chief = {entry.step: entry.value for entry in client.get_metric_history(training.mlflow_run_id, "loss")}
    worker = [float(loss) for loss in re.findall(r"Worker 1: epoch [23]/3, loss (\d+\.\d+)", worker_log(workdir))]
    assert worker == pytest.approx([chief[2], chief[3]], abs=1e-3)
