"""The servers the UI check looks at: a Prefect server with its UI, an MLflow server and a worker, all on 127.0.0.1,
each asking for credentials as docker/compose.yaml's do (Prefect's auth string, MLflow's basic-auth app and the
identities docker/mlflow/identities.py makes); a person signs in to both UIs.

Every process it starts carries a marker in its environment and dies with this script; `Stack.stop` ends them
all, and what they started (a worker's flow runs sit in process groups of their own) by that marker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness import REPO_ROOT
from harness.compose import DOCKER_DIR, generate_secrets
from harness.ports import HOST, free_port
from harness.prefect import isolated_prefect_env, prefect_api
from harness.processes import BIN_DIR, ProcessHandle, run_cli, spawn, stop_all, wait_for_http
from harness.servers import MLFLOW_SERVER_SETTINGS, mlflow_server_command, wait_for_worker

POOL = "cifar-process"
MLFLOW_IDENTITIES = DOCKER_DIR / "mlflow" / "identities.py"  # The stack's service accounts, made the same way.
# MLflow's basic-auth app: users in a SQLite file beside the store, no permission until granted.
MLFLOW_AUTH_CONFIG = """[mlflow]
default_permission = NO_PERMISSIONS
database_uri = sqlite:///{database}
admin_username = admin
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = 60
"""
MARKER_ENV = "CIFAR_UI_CHECK_RUN"  # Every process this script starts carries it: the final sweep for leftovers.
WORKER = "prefect-worker"


class StackError(RuntimeError):
    """The servers, the deployment or a run failed: nothing to check in the UIs."""


@contextlib.contextmanager
def as_stack_error(what: str = "") -> Iterator[None]:
    """A process that exited or a server that never answered (the harness's errors) as a StackError."""
    try:
        yield
    except (RuntimeError, TimeoutError) as error:
        if isinstance(error, StackError):
            raise
        raise StackError(f"{what}: {error}" if what else str(error)) from None


def die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when this script dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def marked_pids(marker: str) -> list[int]:
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def base_env() -> dict[str, str]:
    """This environment without PREFECT_*/MLFLOW_* settings, offline (no telemetry), the venv's bin first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(
        PYTHONUNBUFFERED="1",
        TF_CPP_MIN_LOG_LEVEL="2",
        MLFLOW_DISABLE_TELEMETRY="true",  # Offline: nothing to send, nothing to wait for.
        DO_NOT_TRACK="true",
        PATH=f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


@dataclass
class Stack:
    tmp: Path
    marker: str
    processes: dict[str, ProcessHandle] = field(default_factory=dict)
    prefect_url: str = ""
    mlflow_url: str = ""
    prefect_env: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)  # harness.compose.SECRET_VARIABLES, generated.

    @property
    def api(self) -> str:
        return f"{self.prefect_url}/api"

    def account(self, name: str) -> tuple[str, str]:
        """(user, password) of the Prefect auth string ("prefect") or an MLflow account (admin, worker, viewer)."""
        if name == "prefect":
            user, _, password = self.secrets["PREFECT_AUTH_STRING"].partition(":")
            return user, password
        users = {"admin": "admin", "worker": "cifar-worker", "viewer": "viewer"}
        return users[name], self.secrets[f"MLFLOW_{name.upper()}_PASSWORD"]

    def call(self, method: str, url: str, body: object | None = None) -> object:
        """`api` with the credentials of the server `url` is on (MLflow's admin for MLflow)."""
        return api(method, url, body, auth=self.account("prefect" if url.startswith(self.api) else "admin"))

    def spawn(
        self, name: str, command: Sequence[str | Path], env: dict[str, str], cwd: Path | None = None
    ) -> ProcessHandle:
        """`command` in its own process group, marked, dying with this script, logging to logs/<name>.log."""
        log_path = self.tmp / "logs" / f"{name}.log"
        handle = spawn(command, {**env, MARKER_ENV: self.marker}, log_path, cwd=cwd, preexec_fn=die_with_parent)
        self.processes[name] = handle
        return handle

    def logs(self) -> list[Path]:
        return sorted((self.tmp / "logs").glob("*.log"))

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to every process group, SIGKILL to what is left after `grace` seconds, then leftovers."""
        handles = list(self.processes.values())
        stop_all(handles, grace, warn=False)
        for handle in handles:
            handle.signal(signal.SIGKILL)  # Children that outlived their leader, too.
        # Flow-run processes a worker started may sit in groups of their own: end what carries our marker.
        for pid in marked_pids(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def api(method: str, url: str, body: object | None = None, auth: tuple[str, str] | None = None) -> object:
    """A JSON request to either server; a busy answer or a timed-out read is retried (harness.prefect.prefect_api)."""
    try:
        response = prefect_api.request(method, url, json=body, auth=auth)
    except httpx.HTTPError as error:
        raise StackError(f"{method} {url}: {error}") from error
    if response.is_error:
        raise StackError(f"{method} {url}: HTTP {response.status_code} {response.content[:500]!r}")
    return response.json() if response.content else None


def cli(stack: Stack, args: Sequence[str], timeout: float = 300) -> str:
    """A `prefect ...` command against the stack's server, to completion; its output."""
    with as_stack_error():
        return run_cli(args, {**stack.prefect_env, MARKER_ENV: stack.marker}, timeout=timeout).stdout


def start_stack(stack: Stack) -> None:
    """Both servers (started together: each takes a while on a busy machine), the pool, the deployments, a worker."""
    prefect_port, mlflow_port = free_port(), free_port()
    stack.prefect_url, stack.mlflow_url = f"http://{HOST}:{prefect_port}", f"http://{HOST}:{mlflow_port}"
    stack.secrets = generate_secrets({})
    home = stack.tmp / "prefect-home"
    server_env = isolated_prefect_env(
        home,
        stack.api,
        base=base_env(),
        PREFECT_UI_API_URL=stack.api,  # What the browser calls: this server, not the default :4200.
        PREFECT_UI_URL=stack.prefect_url,
        PREFECT_SERVER_API_HOST=HOST,
        PREFECT_SERVER_API_PORT=str(prefect_port),
        PREFECT_UI_STATIC_DIRECTORY=str(stack.tmp / "prefect-ui"),  # Not the shared site-packages copy.
        PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT="false",
        PREFECT_SERVER_API_AUTH_STRING=stack.secrets["PREFECT_AUTH_STRING"],
        PYTHON=sys.executable,
    )
    launcher = REPO_ROOT / "scripts" / "prefect_server.sh"
    prefect = stack.spawn("prefect-server", [launcher, "--host", HOST, "--port", str(prefect_port)], server_env)
    mlflow_env = mlflow_auth_env(stack, mlflow_port)
    mlflow_command = [*mlflow_server_command(stack.tmp / "mlflow", mlflow_port), "--app-name", "basic-auth"]
    mlflow = stack.spawn("mlflow-server", mlflow_command, mlflow_env)
    with as_stack_error("the servers"):
        wait_for_http(f"{stack.api}/health", prefect, 240, what="prefect-server")
        wait_for_http(f"{stack.mlflow_url}/health", mlflow, 240, what="mlflow-server")
        run_cli([sys.executable, str(MLFLOW_IDENTITIES)], mlflow_env, timeout=300)  # The worker and the viewer.
    worker_user, worker_password = stack.account("worker")
    stack.prefect_env = isolated_prefect_env(
        home,
        stack.api,
        base=base_env(),
        PREFECT_API_AUTH_STRING=stack.secrets["PREFECT_AUTH_STRING"],
        MLFLOW_TRACKING_USERNAME=worker_user,  # The flow runs log as the workers' account.
        MLFLOW_TRACKING_PASSWORD=worker_password,
    )
    print(f"prefect  {stack.prefect_url}   mlflow  {stack.mlflow_url}", flush=True)

    cli(stack, ["prefect", "work-pool", "create", POOL, "--type", "process"])
    cli(stack, ["prefect", "concurrency-limit", "create", "training", "1"])
    cli(stack, ["prefect", "--no-prompt", "deploy", "--all"])
    worker = stack.spawn(
        WORKER,
        [BIN_DIR / "prefect", "worker", "start", "--pool", POOL, "--name", "ui-check"],
        {**stack.prefect_env, "PWD": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": ""},
        cwd=REPO_ROOT,
    )
    with as_stack_error("the worker did not start"):
        wait_for_worker(worker, 120)


def mlflow_auth_env(stack: Stack, port: int) -> dict[str, str]:
    """The MLflow server's environment with its basic-auth app configured, and what identities.py reads."""
    config = stack.tmp / "mlflow-auth.ini"
    config.write_text(MLFLOW_AUTH_CONFIG.format(database=stack.tmp / "mlflow" / "auth.db"), encoding="utf-8")
    (stack.tmp / "mlflow").mkdir(parents=True, exist_ok=True)
    return {
        **base_env(),
        **MLFLOW_SERVER_SETTINGS,
        "MLFLOW_AUTH_CONFIG_PATH": str(config),
        "MLFLOW_AUTH_ADMIN_PASSWORD": stack.secrets["MLFLOW_ADMIN_PASSWORD"],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": stack.secrets["MLFLOW_SECRET_KEY"],
        "MLFLOW_PORT": str(port),
        "MLFLOW_WORKER_PASSWORD": stack.secrets["MLFLOW_WORKER_PASSWORD"],
        "MLFLOW_VIEWER_PASSWORD": stack.secrets["MLFLOW_VIEWER_PASSWORD"],
    }


def worker_alive(stack: Stack) -> None:
    """StackError with the worker's log when it has exited."""
    worker = stack.processes[WORKER]
    if not worker.alive():
        raise StackError(f"the worker exited:\n{worker.logs()[-3000:]}")


def start_endpoint(stack: Stack) -> str:
    """The endpoint (flows/serve.py) over the MLflow server's registry, read as the viewer, as the compose `serve`
    service reads it; its URL once it serves a verified version."""
    port = free_port()
    viewer, password = stack.account("viewer")
    env = {**base_env(), "MLFLOW_TRACKING_USERNAME": viewer, "MLFLOW_TRACKING_PASSWORD": password}
    command = [sys.executable, REPO_ROOT / "flows" / "serve.py", "--tracking-uri", stack.mlflow_url,
               "--host", HOST, "--port", str(port)]  # fmt: skip
    handle = stack.spawn("endpoint", command, env, cwd=REPO_ROOT)
    url = f"http://{HOST}:{port}"
    wait_for_http(f"{url}/health/ready", handle, 180, what="the endpoint")
    return url
