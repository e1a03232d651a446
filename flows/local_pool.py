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
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
POOL = "cifar-process"  # The pool prefect.yaml's deployments use; on a temporary server it is ours alone.
TRIAL_DEPLOYMENT_NAME = "trial"
TRAINING_TAG = "training"  # tasks/training.py's tag: its limit is how many trainings run at once.
START_TIMEOUT_SECONDS = 180.0
STAGE_LOG_ENV = {"PREFECT_LOGGING_EXTRA_LOGGERS": "cifar,tasks"}  # As prefect.yaml's pool: stage logs in the UI.


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def prefect_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


def isolated_env(home: Path, api_url: str | None, **extra: str) -> dict[str, str]:
    """This process's environment with Prefect pointed at `home` (and `api_url`), nothing of the user's profile."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env |= {
        "PREFECT_HOME": str(home),
        "PREFECT_PROFILES_PATH": str(home / "profiles.toml"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_CLI_PROMPT": "false",
        **extra,
    }
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def interruptible() -> None:
    """In a child before it runs: SIGINT back to its default. A search started in the background
    (`cmd &` in a script, nohup) has SIGINT ignored, which children inherit, and `prefect worker
    start` stops its worker with SIGINT: such a worker never stopped, and each cost the stop's timeout."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """A child in this process's group (a kill of the search reaches it), logging to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            command, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=interruptible,
        )  # fmt: skip


def wait_until(ready, process: subprocess.Popen, log_path: Path, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{tail}")
        if ready():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not start within {START_TIMEOUT_SECONDS:.0f} s (log: {log_path})")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def stop(processes: list[subprocess.Popen], timeout: float = 20.0) -> None:
    """SIGTERM to all at once, then SIGKILL to any still running `timeout` seconds later."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in running:
        try:
            process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)


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
    servers: list[subprocess.Popen] = []  # One, once started.
    started_workers: list[subprocess.Popen] = []
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"
        server_log = log_dir / f"search-server-{stamp}.log"
        server_env = isolated_env(home, None, PREFECT_SERVER_UI_ENABLED="false")
        command = prefect_command("server", "start", "--host", HOST, "--port", str(port), "--no-ui")
        server = spawn(command, server_env, server_log)
        servers.append(server)
        wait_until(lambda: healthy(f"{api_url}/health"), server, server_log, "the temporary Prefect server")
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            create_pool_and_deployment(workers)
            worker_env = isolated_env(home, api_url, PWD=str(REPO_ROOT))
            for index in range(workers):
                log_path = log_dir / f"search-worker-{index}-{stamp}.log"
                command = prefect_command("worker", "start", "--pool", POOL, "--limit", "1", "--name", f"local-{index}")
                worker = spawn(command, worker_env, log_path)
                started_workers.append(worker)
                wait_until(lambda path=log_path: "started!" in path.read_text(errors="replace"), worker, log_path,
                           f"worker local-{index}")  # fmt: skip
            print(f"Local work pool {POOL}: {workers} worker(s) on a temporary Prefect server at {api_url}")
            yield api_url
    finally:
        stop(started_workers)  # First, together: they report their flow runs' ends to the server.
        stop(servers)
        shutil.rmtree(home, ignore_errors=True)
