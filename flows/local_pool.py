"""A work pool on this machine for a search without a server: `--parallel K` runs on K real Prefect workers.

`local_work_pool(K)` starts a temporary Prefect server on 127.0.0.1 (its database in a temporary
PREFECT_HOME), creates the process work pool, the `training` concurrency limit (K: one training per
worker) and the trial deployment, and starts K process workers (`prefect worker start --limit 1`)
from the repository root; it yields the API URL and stops all of it on the way out. So a search
with no server dispatches its trials exactly as it does on a server's pool: no second scheduler.

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
TRAINING_TAG = "training"  # tasks/training.py's tag: its limit is how many trainings run at once.
START_TIMEOUT_SECONDS = 180.0
STAGE_LOG_ENV = {"PREFECT_LOGGING_EXTRA_LOGGERS": "cifar,tasks"}  # As prefect.yaml's pool: stage logs in the UI.


def prefect_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


def start(command: list[str], env: dict[str, str], log_path: Path) -> ProcessHandle:
    """A child in this process's group (a kill of the search reaches it), logging to `log_path`."""
    return spawn(command, env, log_path, cwd=REPO_ROOT, own_group=False)


def create_pool_and_deployment(workers: int) -> None:
    """The process pool, the `training` limit and the `cifar/trial` deployment (this checkout) on the server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    from flows.pipeline import cifar_pipeline

    with get_client(sync_client=True) as client:
        template = ProcessWorker.get_default_base_job_template()
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process", base_job_template=template))
        client.create_concurrency_limit(tag=TRAINING_TAG, concurrency_limit=workers)
    # Code from this checkout: the pull step sets the working directory to the repository root.
    source = cifar_pipeline.from_source(source=str(REPO_ROOT), entrypoint="flows/pipeline.py:cifar_pipeline")
    source.to_deployment(
        name=TRIAL_DEPLOYMENT_NAME,
        work_pool_name=POOL,
        job_variables={"env": STAGE_LOG_ENV},
        description="A search trial: the cifar flow with parameters filled in by cifar-search.",
    ).apply()


@contextlib.contextmanager
def local_work_pool(workers: int, log_dir: Path) -> Iterator[str]:
    """A temporary server, pool, deployment and `workers` process workers; yields the API URL.

    Their logs go to `log_dir` (WORKDIR/logs/): the server's and each worker's, flow run output included.
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = Path(tempfile.mkdtemp(prefix="cifar-search-prefect-"))
    port = free_port()
    api_url = f"http://{HOST}:{port}/api"
    servers: list[ProcessHandle] = []  # One, once started.
    started_workers: list[ProcessHandle] = []
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"
        server_env = isolated_prefect_env(home, None, PREFECT_SERVER_UI_ENABLED="false", **SERVER_SETTINGS)
        command = prefect_command("server", "start", "--host", HOST, "--port", str(port), "--no-ui")
        servers.append(start(command, server_env, log_dir / f"search-server-{stamp}.log"))
        wait_for_http(f"{api_url}/health", servers[0], START_TIMEOUT_SECONDS, what="the temporary Prefect server")
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            create_pool_and_deployment(workers)
            worker_env = isolated_prefect_env(home, api_url, PWD=str(REPO_ROOT))
            for index in range(workers):
                command = prefect_command("worker", "start", "--pool", POOL, "--limit", "1", "--name", f"local-{index}")
                started_workers.append(start(command, worker_env, log_dir / f"search-worker-{index}-{stamp}.log"))
                wait_for_worker(started_workers[-1], START_TIMEOUT_SECONDS, f"worker local-{index}")
            print(f"Local work pool {POOL}: {workers} worker(s) on a temporary Prefect server at {api_url}")
            yield api_url
    finally:
        stop_all(started_workers, warn=False)  # First, together: they report their flow runs' ends to the server.
        stop_all(servers, warn=False)
        shutil.rmtree(home, ignore_errors=True)
