"""A work pool on this machine for a search or a multi-worker training without a server: K real Prefect workers.

`local_work_pool(K)` starts a temporary Prefect server on 127.0.0.1 (its database in a temporary
PREFECT_HOME), creates the process work pool, the `training` concurrency limit (K: one training per
worker), the trial deployment and the training-worker deployment, and starts K process workers
(`prefect worker start --limit 1`) from the repository root; it yields the API URL and stops all of it
on the way out. So a search (`--parallel K`) dispatches its trials, and a training with `train.workers`
= K + 1 places its workers, exactly as on a server's pool: no second scheduler.

Each start is a fresh server: flow runs of an earlier attempt are unknown to it, and the search
dispatches their trials again (each resumes its training from its checkpoints).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from harness.ports import HOST, free_port
from harness.prefect import SERVER_SETTINGS, isolated_prefect_env
from harness.processes import ProcessHandle, spawn, stop_all, wait_for_http
from harness.servers import wait_for_worker

REPO_ROOT = Path(__file__).resolve().parents[1]
POOL = "cifar-process"  # The pool prefect.yaml's deployments use; on a temporary server it is ours alone.
TRIAL_DEPLOYMENT_NAME = "trial"
DEPLOYMENTS = [  # (entry point, deployment name, description)
    (
        "flows/pipeline.py:cifar_pipeline",
        TRIAL_DEPLOYMENT_NAME,
        "A search trial: the cifar flow with parameters filled in by cifar-search.",
    ),
    (  # cifar-train-worker/worker: train.worker_deployment's default.
        "flows/training_worker.py:cifar_train_worker",
        "worker",
        "A worker of a multi-worker training, placed by its chief.",
    ),
]
START_TIMEOUT_SECONDS = 180.0
STAGE_LOG_ENV = {"PREFECT_LOGGING_EXTRA_LOGGERS": "cifar,tasks"}  # As prefect.yaml's pool: stage logs in the UI.


def prefect_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


def start(command: list[str], env: dict[str, str], log_path: Path) -> ProcessHandle:
    """A child in this process's group (a kill of the search reaches it), logging to `log_path`."""
    return spawn(command, env, log_path, cwd=REPO_ROOT, own_group=False)


def create_pool_and_deployment(workers: int) -> None:
    """The process pool, the `training` limit, the `cifar/trial` and `cifar-train-worker/worker` deployments (this
    checkout) on the server."""
    from prefect import Flow

    from flows.worker_setup import ensure_pool_and_limit

    ensure_pool_and_limit(POOL, training_slots=workers)  # As a stack's worker makes them, on this new server.
    # Code from this checkout (loaded from its entry point: the flows import this module, not the reverse); the
    # pull step sets the working directory to the repository root.
    for entrypoint, name, description in DEPLOYMENTS:
        Flow.from_source(source=str(REPO_ROOT), entrypoint=entrypoint).to_deployment(
            name=name, work_pool_name=POOL, job_variables={"env": STAGE_LOG_ENV}, description=description
        ).apply()


def flush_api_logs() -> None:
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()


@contextlib.contextmanager
def local_work_pool(workers: int, log_dir: Path) -> Iterator[str]:
    """A temporary server, pool, deployment and `workers` process workers; yields the API URL.

    Their logs go to `log_dir` (WORKDIR/logs/): the server's and each worker's, flow run output included.
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = Path(tempfile.mkdtemp(prefix="cifar-pool-prefect-"))
    port = free_port()
    api_url = f"http://{HOST}:{port}/api"
    servers: list[ProcessHandle] = []  # One, once started.
    started_workers: list[ProcessHandle] = []
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"
        server_env = isolated_prefect_env(home, None, PREFECT_SERVER_UI_ENABLED="false", **SERVER_SETTINGS)
        command = prefect_command("server", "start", "--host", HOST, "--port", str(port), "--no-ui")
        servers.append(start(command, server_env, log_dir / f"pool-server-{stamp}.log"))
        wait_for_http(f"{api_url}/health", servers[0], START_TIMEOUT_SECONDS, what="the temporary Prefect server")
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            create_pool_and_deployment(workers)
            # Polling every 2 s, not Prefect's 10 (a shared server's), starts a training job's workers sooner.
            worker_env = isolated_prefect_env(home, api_url, PWD=str(REPO_ROOT), PREFECT_WORKER_QUERY_SECONDS="2")
            for index in range(workers):
                command = prefect_command("worker", "start", "--pool", POOL, "--limit", "1", "--name", f"local-{index}")
                started_workers.append(start(command, worker_env, log_dir / f"pool-worker-{index}-{stamp}.log"))
                wait_for_worker(started_workers[-1], START_TIMEOUT_SECONDS, f"worker local-{index}")
            print(f"Local work pool {POOL}: {workers} worker(s) on a temporary Prefect server at {api_url}")
            yield api_url
    finally:
        flush_api_logs()  # Records of this process's flow runs still queued for the server reach it first.
        stop_all(started_workers, warn=False)  # First, together: they report their flow runs' ends to the server.
        stop_all(servers, warn=False)
        shutil.rmtree(home, ignore_errors=True)
