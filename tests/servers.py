"""Real servers for integration tests: a Prefect server, a Prefect worker and an MLflow server.

Each runs as a subprocess in its own process group, bound to 127.0.0.1 on a free port, with an
isolated PREFECT_HOME, and logs to a file you can read back (`handle.logs()`) when a test fails.

    server = start_prefect_server(tmp_path / "prefect")            # SQLite under PREFECT_HOME
    server = start_prefect_server(home, database_url="postgresql+asyncpg://...")
    env = server.client_env()                                      # for `prefect ...` subprocesses
    run_cli(["prefect", "work-pool", "create", "pool", "--type", "process"], env=env)
    worker = start_worker(server, pool="pool", cwd=repo_root)
    mlflow = start_mlflow_server(tmp_path / "mlflow")             # mlflow.tracking_uri
    prefect_api.post(f"{server.api_url}/flow_runs/filter", json={})   # REST calls, a busy 503 retried
    ...
    stop_all([worker]); server.stop(); mlflow.stop()           # workers at once, then their server
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flows.local_pool import interruptible

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN_DIR = Path(sys.executable).parent  # The venv's bin: prefect, mlflow.
HOST = "127.0.0.1"


class BusyRetryingTransport(httpx.HTTPTransport):
    """Retries as Prefect's own client does: a 503, which a server answers when its SQLite database is
    busy (a scheduler or a flow run writing at that moment), and, for requests that only read, a
    timeout (the database locked longer than the request may wait, seen in CI with a dozen flow runs
    starting at once). Neither is a failure of what a test checks. Writes are not repeated after a
    timeout: the server may have done them."""

    TRANSIENT = (httpx.ReadTimeout, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.RemoteProtocolError)

    def __init__(self, attempts: int = 6, **kwargs) -> None:
        super().__init__(**kwargs)
        self.attempts = attempts

    @staticmethod
    def reads_only(request: httpx.Request) -> bool:
        return request.method == "GET" or request.url.path.endswith(("/filter", "/count"))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(1, self.attempts):
            try:
                response = super().handle_request(request)
            except self.TRANSIENT:
                if not self.reads_only(request):
                    raise
            else:
                if response.status_code != 503:
                    return response
                response.close()
            time.sleep(2 * attempt)  # Seconds: 30 in all over 6 attempts, like the client's own backoff.
        return super().handle_request(request)


# For the tests' Prefect REST calls; 60 s is the Prefect client's own request timeout.
prefect_api = httpx.Client(transport=BusyRetryingTransport(), timeout=60)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def prefect_env(home: Path, api_url: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a Prefect process isolated in `home` (no user profile, no analytics).

    `api_url=None` means no server: the client starts an ephemeral one.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_PROFILES_PATH=str(home / "profiles.toml"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_CLI_PROMPT="false",
        PREFECT_LOGGING_LEVEL="INFO",
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        PATH=f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}",
    )
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env.update(extra)
    return env


@dataclass
class ProcessHandle:
    """A subprocess in its own process group, logging to `log_path`."""

    process: subprocess.Popen
    log_path: Path
    env: dict[str, str] = field(repr=False)

    def logs(self) -> str:
        """Everything the process has written so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the process group, then SIGKILL if it lingers. Safe to call twice."""
        stop_all([self], timeout)

    def terminate(self) -> None:
        """SIGTERM to the process group, or SIGKILL to what a leader that already exited left behind."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM if self.alive() else signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def wait_or_kill(self, deadline: float) -> None:
        """Waits for the leader until `deadline` (time.monotonic()), then SIGKILLs its group."""
        try:
            self.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            # Said, not hidden: a worker still running a flow run, a server stuck in shutdown. Killing
            # it is harmless (its home is a test's temporary directory); the seconds are what it cost.
            warnings.warn(
                f"{' '.join(map(str, self.process.args[:3]))} still ran at the stop's deadline after SIGTERM: killed",
                stacklevel=3,
            )
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(20)


def stop_all(handles: Sequence[ProcessHandle | None], timeout: float = 20.0) -> None:
    """Stops processes at once: the SIGTERMs go out together and the processes share one `timeout`, so
    n lingering ones cost one timeout, not n. Stop workers before their server (a worker stopping
    reports its flow runs' ends to the server)."""
    handles = [handle for handle in handles if handle is not None]
    for handle in handles:
        handle.terminate()
    deadline = time.monotonic() + timeout
    for handle in handles:
        handle.wait_or_kill(deadline)


@dataclass
class ServerHandle(ProcessHandle):
    """A server subprocess and where to reach it."""

    url: str = ""  # e.g. http://127.0.0.1:4321
    api_url: str = ""  # Prefect: URL + /api; MLflow: the tracking URI (= url).
    home: Path | None = None  # Prefect: the isolated PREFECT_HOME.

    def client_env(self, **extra: str) -> dict[str, str]:
        """Environment for Prefect CLI/flow subprocesses talking to this server (Prefect only)."""
        if self.home is None:
            raise ValueError("client_env is for Prefect servers")
        return prefect_env(self.home, self.api_url, **extra)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _spawn(command: Sequence[str], env: dict[str, str], log_path: Path, cwd: Path | None = None) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")  # The child keeps its own descriptor; ours closes with the Popen.
    try:
        return subprocess.Popen(
            list(command),
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=interruptible,  # A worker stops on SIGINT, which a suite run in the background ignores.
        )
    finally:
        log.close()


def wait_for_http(url: str, handle: ProcessHandle, timeout: float, expect: str | None = None) -> None:
    """Polls `url` until it answers 200 (and contains `expect`); fails early if the process died."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        if not handle.alive():
            raise RuntimeError(f"server exited with {handle.process.returncode}:\n{handle.logs()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = response.read().decode("utf-8", errors="replace")
                if response.status == 200 and (expect is None or expect in body):
                    return
                last_error = f"HTTP {response.status}: {body[:200]}"
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
            last_error = str(error)
        time.sleep(0.5)
    handle.stop()
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s ({last_error}):\n{handle.logs()[-4000:]}")


def start_prefect_server(
    home: Path,
    database_url: str | None = None,
    *,
    port: int | None = None,
    timeout: float = 180.0,
    launcher: Sequence[str] | None = None,
    **settings: str,
) -> ServerHandle:
    """`prefect server start` on 127.0.0.1:<free port> with PREFECT_HOME=`home`; returns once healthy.

    `database_url` (e.g. `postgresql+asyncpg://user:pw@127.0.0.1:5432/prefect`) replaces the default
    SQLite database under `home`; `settings` are extra PREFECT_* environment variables. `launcher`
    replaces `prefect server start` with a command taking the same options (scripts/prefect_server.sh).
    """
    home = Path(home)
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    env = prefect_env(home, None, PREFECT_SERVER_UI_ENABLED="false", **settings)
    if database_url:
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database_url
    env["PYTHON"] = sys.executable  # For a launcher script.
    start = list(launcher) if launcher else [str(BIN_DIR / "prefect"), "server", "start"]
    command = [*start, "--host", HOST, "--port", str(port), "--no-ui"]
    log_path = home / "server.log"
    handle = ServerHandle(_spawn(command, env, log_path), log_path, env, url=url, api_url=f"{url}/api", home=home)
    wait_for_http(f"{url}/api/health", handle, timeout)
    return handle


def start_worker(
    server: ServerHandle,
    pool: str,
    *,
    cwd: Path = REPO_ROOT,
    name: str | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> ProcessHandle:
    """`prefect worker start --pool POOL` against `server`; returns once the worker has polled the pool."""
    env = server.client_env(**(extra_env or {}))
    name = name or f"worker-{free_port()}"
    command = [str(BIN_DIR / "prefect"), "worker", "start", "--pool", pool, "--name", name]
    log_path = Path(server.home) / f"{name}.log"
    handle = ProcessHandle(_spawn(command, env, log_path, cwd=cwd), log_path, env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not handle.alive():
            raise RuntimeError(f"worker exited with {handle.process.returncode}:\n{handle.logs()[-4000:]}")
        if "started!" in handle.logs():
            return handle
        time.sleep(0.5)
    handle.stop()
    raise TimeoutError(f"worker did not start within {timeout:.0f}s:\n{handle.logs()[-4000:]}")


def start_mlflow_server(root: Path, *, port: int | None = None, timeout: float = 180.0) -> ServerHandle:
    """`mlflow server` with a SQLite store and artifacts under `root`; `.api_url` is the tracking URI."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    env = {key: value for key, value in os.environ.items() if not key.startswith("MLFLOW_")}
    env["PYTHONUNBUFFERED"] = "1"
    command = [
        str(BIN_DIR / "mlflow"),
        "server",
        "--host",
        HOST,
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
    ]
    log_path = root / "mlflow-server.log"
    handle = ServerHandle(_spawn(command, env, log_path), log_path, env, url=url, api_url=url)
    wait_for_http(f"{url}/health", handle, timeout)
    return handle


def run_cli(
    args: Sequence[str], env: dict[str, str], *, cwd: Path = REPO_ROOT, timeout: float = 300.0, check: bool = True
) -> subprocess.CompletedProcess:
    """Runs a CLI (`prefect ...`, `python ...`) to completion; raises with its output on failure."""
    args = list(args)
    if args and args[0] in {"prefect", "mlflow"}:
        args[0] = str(BIN_DIR / args[0])
    elif args and args[0] == "python":
        args[0] = sys.executable
    result = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} exited with {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n"
            f"--- stderr\n{result.stderr[-6000:]}"
        )
    return result
