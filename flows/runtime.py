"""What every flow shares: dry-run plans, stage logs, run names, and the supervised command line (`run_command`).

Each flow file imports this module first (its own isort section in pyproject.toml), so the package's
quiet prelude (flows/__init__.py) runs before TensorFlow, MLflow or Prefect load. No flow is imported
here: flows depend on the runtime, never the other way (tests/test_imports.py).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from prefect.runtime import deployment, flow_run
from pydantic import BaseModel, ConfigDict

from cifar import locks
from cifar.config import ConfigOverrides, PipelineConfig
from cifar.io import atomic_write_json
from cifar.preemption import STOPPED_EXIT_CODE, TrainingPreempted
from cifar.preflight import ImpossibleRequestError
from cifar.quiet import VERBOSE_ENV, route_framework_logs

REPO_ROOT = Path(__file__).resolve().parents[1]
DRY_RUN_ENV = "CIFAR_DRY_RUN"  # A directory: each flow run writes its resolved plan there and runs nothing.
STAGE_LOGGERS = ("cifar", "tasks")  # PREFECT_LOGGING_EXTRA_LOGGERS=cifar,tasks also sends them to the API.
SUPERVISED_ENV = "CIFAR_PIPELINE_SUPERVISED"  # Set in the child: it runs the flow instead of supervising.
PR_SET_CHILD_SUBREAPER = 36  # prctl option (Linux): orphaned descendants are re-parented to this process.
# After a SIGTERM, how long the run gets to save and end before it is killed. Training saves within two
# steps (cifar.callbacks.SaveOnSigterm); give `docker stop -t` / terminationGracePeriodSeconds at least this.
STOP_GRACE_SECONDS = 60


# --- Inside a flow run. ----------------------------------------------------------------------------


class DryRunPlan(BaseModel):
    """What a flow run would do, written instead of doing it when the worker has CIFAR_DRY_RUN=DIR."""

    model_config = ConfigDict(extra="forbid")

    dry_run: Literal[True] = True
    flow: str
    flow_run_id: str
    deployment_id: str | None
    workdir: str
    config: PipelineConfig | None  # Resolved and through the pre-flight checks; None for a flow without one.
    details: dict[str, Any]  # The flow's other parameters (until, force, path, ...).
    summary_path: str  # DIR/<flow run id>/summary.json

    @classmethod
    def read(cls, path: str | Path) -> DryRunPlan:
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))

    def describe(self) -> str:
        return f"Dry run ({DRY_RUN_ENV}): the resolved plan of {self.flow} written to {self.summary_path}"


def dry_run_plan(flow_name: str, config: PipelineConfig | None, workdir: str, **details: Any) -> DryRunPlan | None:
    """With CIFAR_DRY_RUN=DIR set on the worker: the run's resolved plan, written to DIR/<flow run id>/summary.json.

    A worker started this way checks what deployments and forms would run (their resolved config,
    validated and through the pre-flight checks) without downloading, training or writing to a workdir.
    Without the variable this returns None and the flow runs as usual.
    """
    directory = os.environ.get(DRY_RUN_ENV)
    if not directory:
        return None
    run_id = flow_run.get_id() or "local"
    path = Path(directory) / run_id / "summary.json"
    plan = DryRunPlan(
        flow=flow_name,
        flow_run_id=run_id,
        deployment_id=deployment.get_id() or flow_run.get_parent_deployment_id(),
        workdir=str(Path(workdir).resolve()),
        config=config,
        details=details,
        summary_path=str(path),
    )
    atomic_write_json(path, plan.model_dump(mode="json"))
    print(plan.describe())
    return plan


def show_stage_logs() -> None:
    """Lets the stages' INFO messages through (Prefect's root logger stops at WARNING)."""
    for name in STAGE_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)


def named_by_config(describe: Callable[[PipelineConfig], str], invalid: str) -> Callable[[], str]:
    """A flow's `flow_run_name`: `describe` of the run's resolved `config` parameter, what a person scanning
    the Prefect UI needs, or `invalid` when it does not resolve (the run then fails on it, naming the field)."""

    def flow_run_name() -> str:
        try:
            config = ConfigOverrides.model_validate(flow_run.parameters.get("config") or {}).resolve()
        except ValueError:
            return invalid
        return describe(config)

    return flow_run_name


# --- The command line. -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """A command line checked before any work: where its log goes, and its flow run (in the supervised child)."""

    workdir: Path
    run: Callable[[], int]  # Runs the flow, prints its result, returns the exit code.
    # Without PREFECT_API_URL the run needs Prefect's temporary server (False: it brings a server of its own).
    temporary_server: bool = True


def run_command(
    script: str,
    parser: argparse.ArgumentParser,
    check: Callable[[argparse.Namespace], Request | int],
    argv: Sequence[str] | None = None,
    *,
    ephemeral_server: bool = True,
    error_type: bool = False,
) -> int:
    """The command line of `flows/<script>.py`: 2 for a bad request (before any work), else the run's code.

    `check(args)` validates the request (ValueError or ImpossibleRequestError: one `error:` line, exit 2)
    and returns a Request, or an exit code when it answered without a flow run. The flow then runs in a
    supervised child (Linux) whose log goes to WORKDIR/logs/<script>-*.log; a failure prints one `error:`
    line (with the exception's type when `error_type`) and exits 1. `ephemeral_server`: the flow may start
    Prefect's temporary server, whose database is prepared first.
    """
    args = parser.parse_args(argv)
    try:
        request = check(args)
    except (ValueError, ImpossibleRequestError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2  # Before any work: nothing was started or written.
    if isinstance(request, int):
        return request
    server = None
    if os.environ.get(SUPERVISED_ENV) != "1" and sys.platform == "linux":
        if ephemeral_server and request.temporary_server and prepare_ephemeral_database():
            server = TemporaryServer.start()
        try:
            code = supervise(script, sys.argv[1:] if argv is None else list(argv), fork=argv is None, server=server)
        except BaseException:
            if server is not None:
                server.stop()
            raise
        if code is not None:
            return code
    log_path = log_to_file(request.workdir, script)
    try:
        with TemporaryServer.in_use(server):
            return request.run()
    except TrainingPreempted as stopped:  # SIGTERM during training: its state is saved, nothing failed.
        print(f"stopped: {stopped} (full log: {log_path})", file=sys.stderr)
        return STOPPED_EXIT_CODE
    except Exception as error:
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(traceback.format_exc())
        described = f"{type(error).__name__}: {error}" if error_type else str(error)
        print(f"error: {described} (full log: {log_path})", file=sys.stderr)
        return 1


def supervise(script: str, argv: list[str], *, fork: bool = False, server: TemporaryServer | None = None) -> int | None:
    """Runs `flows/<script>.py` in a child process; afterwards no process it started is left running.

    The one place that watches a run's processes. A SIGTERM (`docker stop`, a Kubernetes eviction, `kill PID`)
    is forwarded to the child, which saves and ends (training: `cifar.callbacks.SaveOnSigterm`; elsewhere
    Prefect records the flow run as crashed); the child is killed if it has not ended `STOP_GRACE_SECONDS` later.
    `fork`: the child is a fork of this process and gets None back (it runs the flow); else a new interpreter.
    `server`: the temporary Prefect server the child's flow runs against (it outlives the child: the caller
    stops it once the child has recorded how its flow run ended).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # Its orphans become ours to end.
    import psutil

    if fork:
        # The command line's own process: it has imported the flow and checked the request with one Python
        # thread (no framework has started its own yet), so a fork saves the child those seconds again.
        pid = os.fork()
        if pid == 0:
            os.environ[SUPERVISED_ENV] = "1"
            return None
        child: subprocess.Popen | psutil.Process = psutil.Process(pid)
    else:
        command = [sys.executable, str(REPO_ROOT / "flows" / f"{script}.py"), *argv]
        environment = {**os.environ, SUPERVISED_ENV: "1", **(server.client_environment() if server else {})}
        child = subprocess.Popen(command, env=environment)  # Same group: Ctrl-C reaches it.
    deadline, stopping = threading.Timer(STOP_GRACE_SECONDS, child.kill), threading.Event()
    deadline.daemon = True

    def forward_sigterm(signum, frame) -> None:
        if not stopping.is_set():
            stopping.set()
            child.send_signal(signal.SIGTERM)
            deadline.start()

    signal.signal(signal.SIGTERM, forward_sigterm)
    try:
        code = child.wait()
    except KeyboardInterrupt:
        code = child.wait()
    finally:
        deadline.cancel()
        if server is not None:  # Asked first (a SIGKILL would cut short what it writes), then ended as the rest.
            server.stop()
        leftovers = psutil.Process().children(recursive=True)
        for process in leftovers:
            process.kill()
        psutil.wait_procs(leftovers, timeout=10)
    if stopping.is_set():
        return stopped_by_sigterm(script, code)
    if code < 0:
        name = signal.Signals(-code).name
        print(
            f"error: the {script} process was killed by {name} (out of memory, or stopped by hand); "
            "run the same command again to resume",
            file=sys.stderr,
        )
        return 1
    return code


def stopped_by_sigterm(script: str, code: int) -> int:
    """The supervisor's exit code after it forwarded a SIGTERM; one line unless the child said what it saved."""
    if code in (0, STOPPED_EXIT_CODE):  # Finished anyway, or stopped training and said so.
        return code
    how = f"did not end within {STOP_GRACE_SECONDS} s and was killed" if code == -signal.SIGKILL else "ended"
    print(
        f"stopped: the {script} process was asked to stop (SIGTERM) and {how}; finished stages and epochs are "
        "kept: run the same command again to resume",
        file=sys.stderr,
    )
    return STOPPED_EXIT_CODE


def prepare_ephemeral_database() -> bool:
    """Migrates Prefect's own SQLite database and registers its block types, under a lock, when no server is
    configured; whether a run needs a temporary server (no PREFECT_API_URL).

    Without a server every run starts a temporary one, which migrates the database under PREFECT_HOME
    and registers Prefect's block types when they are new to it (a fresh machine, an upgraded Prefect);
    runs started at once would do it together and collide (flows/prefect_database.py). Done here once
    per installed Prefect, recorded beside the database.
    """
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        return False
    if not settings.server.ephemeral.enabled:
        return False  # Prefect's client says so, naming PREFECT_API_URL, when the flow starts.
    url = settings.server.database.connection_url.get_secret_value()
    if not url.startswith("sqlite+aiosqlite:///"):
        return True
    database = Path(url.removeprefix("sqlite+aiosqlite:///"))
    prepared_for, versions = database.with_name(f".{database.name}.prepared"), prefect_versions()
    with locks.exclusive(database.with_name(f".{database.name}.lock"), f"Prefect's database {database}"):
        if database.exists() and prepared_for.exists() and prepared_for.read_text(encoding="utf-8") == versions:
            return True
        command = [sys.executable, str(REPO_ROOT / "flows" / "prefect_database.py")]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"could not prepare Prefect's database {database}:\n{result.stderr[-3000:]}")
        prepared_for.write_text(versions, encoding="utf-8")  # Under the lock: nobody reads it half-written.
    return True


class TemporaryServer:
    """Prefect's temporary server for one command-line run, started beside the run by its supervisor.

    With no PREFECT_API_URL, Prefect's client starts this very server (`SubprocessASGIServer`: uvicorn with
    Prefect's app factory in ephemeral mode, on PREFECT_HOME's database) from inside the flow's process,
    after importing Prefect's whole server package there only to do so (~1.5 s of CPU, a quarter of the
    run's start-up). Started here instead, the run's process imports none of it; the server outlives the
    run, records how it ended, and is stopped by the supervisor. The command and environment are Prefect's
    own (tests/test_cli.py compares them, so an upgrade that changes them fails there).
    """

    def __init__(self, process: subprocess.Popen, port: int) -> None:
        self.process, self.port = process, port
        self.api_url = f"http://127.0.0.1:{port}/api"

    @staticmethod
    def command(port: int) -> list[str]:
        import prefect

        return [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "error", "--lifespan", "on"]  # fmt: skip

    @staticmethod
    def environment() -> dict[str, str]:
        from prefect.settings import get_current_settings

        server = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        return {**os.environ, **server, **get_current_settings().to_environment_variables(exclude_unset=True)}

    @classmethod
    def start(cls) -> TemporaryServer:
        """Starts it on a free port and returns once it answers (RuntimeError with its output if it cannot)."""
        from prefect.logging import get_logger
        from prefect.settings import get_current_settings

        from harness.ports import free_port

        timeout = get_current_settings().server.ephemeral.startup_timeout_seconds
        deadline = time.monotonic() + timeout
        while True:
            port = free_port()
            server = cls(subprocess.Popen(cls.command(port), env=cls.environment()), port)
            get_logger().info(f"Starting temporary server on http://127.0.0.1:{port}")
            while time.monotonic() < deadline and server.process.poll() is None and not server.answers():
                time.sleep(0.1)
            if server.process.poll() == 3:  # Uvicorn's exit when the port was taken meanwhile: another one.
                continue
            if server.process.poll() is None and server.answers():
                return server
            server.stop()
            raise RuntimeError(
                f"Prefect's temporary server did not start within {timeout:.0f} s "
                f"(exit status {server.process.returncode}); PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS "
                "allows longer, or set PREFECT_API_URL to a running server"
            )

    def answers(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def client_environment(self) -> dict[str, str]:
        """The run's Prefect settings: this server's API, and no UI link (the temporary server has no UI)."""
        return {"PREFECT_API_URL": self.api_url, "PREFECT_UI_URL": ""}

    @staticmethod
    @contextlib.contextmanager
    def in_use(server: TemporaryServer | None) -> Iterator[None]:
        """This process's Prefect client talks to `server` (none: as configured)."""
        if server is None:
            yield
            return
        from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_UI_URL: ""}):
            yield

    def stop(self) -> None:
        """SIGTERM, 5 s to finish what it writes, then SIGKILL (what Prefect's client does at its exit)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def prefect_versions() -> str:
    """The installed Prefect distributions (`prefect==3.8.8`, any collection): its migrations and block types."""
    names = {distribution.metadata["Name"] or "" for distribution in importlib.metadata.distributions()}
    prefects = sorted(name for name in names if name.lower().startswith("prefect"))
    return "".join(f"{name}=={importlib.metadata.version(name)}\n" for name in prefects)


class FirstLineFormatter(logging.Formatter):
    """Formats a record as `formatter` does, without its traceback: the terminal gets one line per record."""

    def __init__(self, formatter: logging.Formatter | None) -> None:
        super().__init__()
        self.formatter = formatter or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.formatter.format(record).split("\n", 1)[0]
        finally:
            record.exc_info, record.exc_text = saved


def log_to_file(workdir: Path, name: str = "pipeline") -> Path:
    """Every record, tracebacks and the frameworks' own lines included, goes to
    WORKDIR/logs/<name>-<UTC time>-<pid>.log; the terminal keeps one line of each of ours."""
    path = workdir / "logs" / f"{name}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{os.getpid()}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    terminals = [
        handler
        for handler in root.handlers
        if type(handler) is not logging.FileHandler and isinstance(handler, logging.StreamHandler)
    ]
    for handler in terminals:
        handler.setFormatter(FirstLineFormatter(handler.formatter))
    root.addHandler(file_handler)
    route_framework_logs(terminals if os.environ.get(VERBOSE_ENV) != "1" else [])
    return path
