"""Real servers on 127.0.0.1, each on a free port: a Prefect server and its workers, an MLflow tracking
server, an MLflow model server. Each start returns once the server answers (or raises with its log).

    server = start_prefect_server(tmp_path / "prefect")            # SQLite under its isolated PREFECT_HOME
    server = start_prefect_server(home, database_url="postgresql+asyncpg://...")
    env = deploy_project(server, "pool")                           # as `make deploy`; the clients' env
    worker = start_worker(server, pool="pool", cwd=repo_root)
    mlflow = start_mlflow_server(tmp_path / "mlflow")             # .api_url: the tracking URI
    stop_all([worker]); server.stop(); mlflow.stop()           # workers at once, then their server
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness import REPO_ROOT
from harness.ports import HOST, free_port
from harness.prefect import SERVER_SETTINGS, prefect_env
from harness.processes import BIN_DIR, ProcessHandle, run_cli, spawn, wait_for_http, wait_until

WORKER_STARTED = "started!"  # What `prefect worker start` logs once it polls its pool.


@dataclass
class ServerHandle(ProcessHandle):
    """A server subprocess and where to reach it."""

    url: str = ""  # e.g. http://127.0.0.1:4321
    api_url: str = ""  # Prefect: URL + /api; MLflow: the tracking URI (= url).
    home: Path | None = None  # Prefect: the isolated PREFECT_HOME.

    @classmethod
    def of(cls, handle: ProcessHandle, url: str, api_url: str, home: Path | None = None) -> ServerHandle:
        return cls(handle.process, handle.log_path, handle.env, handle.own_group, url, api_url, home)

    def client_env(self, **extra: str) -> dict[str, str]:
        """Environment for Prefect CLI/flow subprocesses talking to this server (Prefect only)."""
        if self.home is None:
            raise ValueError("client_env is for Prefect servers")
        return prefect_env(self.home, self.api_url, **extra)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_prefect_server(
    home: Path,
    database_url: str | None = None,
    *,
    port: int | None = None,
    timeout: float = 180.0,
    launcher: Sequence[str] | None = None,
    **settings: str,
) -> ServerHandle:
    """`prefect server start` (no UI) with PREFECT_HOME=`home`; returns once healthy.

    `database_url` (e.g. `postgresql+asyncpg://user:pw@127.0.0.1:5432/prefect`) replaces the default
    SQLite database under `home`; `settings` are extra PREFECT_* environment variables. `launcher`
    replaces `prefect server start` with a command taking the same options (scripts/prefect_server.sh).
    """
    home = Path(home)
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    env = prefect_env(home, None, PREFECT_SERVER_UI_ENABLED="false", **{**SERVER_SETTINGS, **settings})
    if database_url:
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database_url
    env["PYTHON"] = sys.executable  # For a launcher script.
    start = list(launcher) if launcher else [str(BIN_DIR / "prefect"), "server", "start"]
    command = [*start, "--host", HOST, "--port", str(port), "--no-ui"]
    handle = ServerHandle.of(spawn(command, env, home / "server.log"), url, f"{url}/api", home)
    wait_for_http(f"{url}/api/health", handle, timeout)
    return handle


def deploy_project(
    server: ServerHandle, pool: str, training_slots: int = 1, names: Sequence[str] = ()
) -> dict[str, str]:
    """What `make deploy` does on `server`: the process pool, the `training` limit, every deployment of
    prefect.yaml (or those `names`, as `prefect deploy --name`). Returns the clients' environment."""
    env = server.client_env()
    run_cli(["prefect", "work-pool", "create", pool, "--type", "process"], env=env)
    run_cli(["prefect", "concurrency-limit", "create", "training", str(training_slots)], env=env)
    chosen = [word for name in names for word in ("--name", name)] or ["--all"]
    run_cli(["prefect", "--no-prompt", "deploy", *chosen], env=env, cwd=REPO_ROOT)
    return env


def wait_for_worker(handle: ProcessHandle, timeout: float, what: str = "worker") -> None:
    """Returns once a `prefect worker start` has polled its pool (RuntimeError/TimeoutError with its log)."""
    wait_until(handle, lambda: WORKER_STARTED in handle.logs(), timeout, what)


def start_worker(
    server: ServerHandle,
    pool: str,
    *,
    cwd: Path = REPO_ROOT,
    name: str | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> ProcessHandle:
    """`prefect worker start --pool POOL` against `server`; returns once the worker has polled the pool.
    It asks for work every second (Prefect's default, 10 s, made each deployment run wait 5 s on average)."""
    env = server.client_env(**{"PREFECT_WORKER_QUERY_SECONDS": "1", **(extra_env or {})})
    name = name or f"worker-{free_port()}"
    command = [str(BIN_DIR / "prefect"), "worker", "start", "--pool", pool, "--name", name]
    handle = spawn(command, env, Path(server.home) / f"{name}.log", cwd=cwd)
    wait_for_worker(handle, timeout)
    return handle


def mlflow_server_command(root: Path, port: int) -> list[str]:
    """`mlflow server` on 127.0.0.1:`port` with a SQLite store and artifacts under `root` (created)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    store = f"sqlite:///{root / 'mlflow.db'}"
    return [str(BIN_DIR / "mlflow"), "server", "--host", HOST, "--port", str(port), "--workers", "1",
            "--backend-store-uri", store, "--artifacts-destination", str(root / "artifacts")]  # fmt: skip


# As docker/compose.yaml runs it: without MLflow 3's job runner, 8 processes of GenAI jobs we never use
# (measured: 12 s of CPU in a server's first 20 s; a quarter of `make test`'s CPU before it was off).
MLFLOW_SERVER_SETTINGS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def without_mlflow_settings(**extra: str) -> dict[str, str]:
    """This process's environment without MLFLOW_* (no tracking URI of the caller's leaks in), plus `extra`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MLFLOW_")}
    return env | extra


def start_mlflow_server(root: Path, *, port: int | None = None, timeout: float = 180.0) -> ServerHandle:
    """`mlflow server` with a SQLite store and artifacts under `root`; `.api_url` is the tracking URI."""
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    env = without_mlflow_settings(PYTHONUNBUFFERED="1", **MLFLOW_SERVER_SETTINGS)
    handle = ServerHandle.of(spawn(mlflow_server_command(root, port), env, Path(root) / "mlflow-server.log"), url, url)
    wait_for_http(f"{url}/health", handle, timeout)
    return handle


def start_model_server(
    model_uri: str,
    tracking_uri: str,
    log_path: Path,
    *,
    cwd: Path | None = None,
    timeout: float = 180.0,
    **settings: str,
) -> ServerHandle:
    """`mlflow models serve` of `model_uri` in this environment (one worker); returns once it answers /ping.
    `settings`: extra environment variables (MLFLOW_* ones too)."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    # The scoring server is started as `uvicorn ...` from PATH: this venv's bin goes first.
    env = without_mlflow_settings(
        MLFLOW_TRACKING_URI=tracking_uri,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        PATH=f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}",
        **settings,
    )
    command = [str(BIN_DIR / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local",
               "-h", HOST, "-p", str(port), "--workers", "1"]  # fmt: skip
    handle = ServerHandle.of(spawn(command, env, log_path, cwd=cwd), url, url)
    wait_for_http(f"{url}/ping", handle, timeout, what="mlflow models serve")
    return handle


def start_endpoint(tracking_uri: str, log_path: Path, *, timeout: float = 180.0, **flags: str) -> ServerHandle:
    """The project's endpoint (`flows/serve.py`) over `tracking_uri`'s registry on a free port; returns once it is
    ready (a verified version served). `flags`: its command-line flags (max_batch="32" -> --max-batch 32)."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    env = without_mlflow_settings(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    command = [sys.executable, str(REPO_ROOT / "flows" / "serve.py"), "--tracking-uri", tracking_uri,
               "--host", HOST, "--port", str(port)]  # fmt: skip
    for name, value in flags.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    handle = ServerHandle.of(spawn(command, env, log_path, cwd=REPO_ROOT), url, url)
    wait_for_http(f"{url}/health/ready", handle, timeout, what="the endpoint")
    return handle
