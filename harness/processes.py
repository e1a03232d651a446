"""Child processes that stop cleanly: each leads its own process group and logs to a file you can read back.

handle = spawn([...], env, log_path, cwd=...)           # a ProcessHandle; handle.logs() when it fails
wait_for_http(f"http://{HOST}:{port}/health", handle, timeout=180)
stop_all([worker_1, worker_2]); server.stop()           # the SIGTERMs at once, one shared timeout
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness import REPO_ROOT

BIN_DIR = Path(sys.executable).parent  # The venv's bin: prefect, mlflow.


def interruptible() -> None:
    """In a child before it runs: SIGINT back to its default. A process started in the background
    (`cmd &` in a script, nohup) has SIGINT ignored, which children inherit, and `prefect worker
    start` stops its worker with SIGINT: such a worker never stopped, and each cost the stop's timeout."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class ProcessHandle:
    """A subprocess logging to `log_path`; with `own_group` (the default) it leads a process group of its own,
    so a signal reaches everything it started (a server's workers, a worker's flow runs)."""

    process: subprocess.Popen
    log_path: Path
    env: dict[str, str] = field(repr=False)
    own_group: bool = True

    def logs(self) -> str:
        """Everything the process has written so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, number: int) -> None:
        """`number` to the process group, or, without one of its own, to the process while it runs."""
        try:
            if self.own_group:
                os.killpg(self.process.pid, number)
            elif self.alive():
                self.process.send_signal(number)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL if it lingers. Safe to call twice."""
        stop_all([self], timeout)

    def terminate(self) -> None:
        """SIGTERM, or SIGKILL to what a group leader that already exited left behind."""
        self.signal(signal.SIGTERM if self.alive() else signal.SIGKILL)

    def wait_or_kill(self, deadline: float, *, warn: bool = True) -> None:
        """Waits for the process until `deadline` (time.monotonic()), then SIGKILLs it (its group)."""
        try:
            self.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            if warn:
                # Said, not hidden: a worker still running a flow run, a server stuck in shutdown. Killing
                # it is harmless (its home is temporary); the seconds are what it cost.
                command = " ".join(map(str, self.process.args[:3]))
                warnings.warn(f"{command} still ran at the stop's deadline after SIGTERM: killed", stacklevel=3)
            self.signal(signal.SIGKILL)
            self.process.wait(20)


def stop_all(handles: Sequence[ProcessHandle | None], timeout: float = 20.0, *, warn: bool = True) -> None:
    """Stops processes at once: the SIGTERMs go out together and the processes share one `timeout`, so
    n lingering ones cost one timeout, not n; each one killed is a warning (`warn`). Stop workers before
    their server (a worker stopping reports its flow runs' ends to the server)."""
    handles = [handle for handle in handles if handle is not None]
    for handle in handles:
        handle.terminate()
    deadline = time.monotonic() + timeout
    for handle in handles:
        handle.wait_or_kill(deadline, warn=warn)


def spawn(
    command: Sequence[str | Path],
    env: dict[str, str],
    log_path: Path,
    *,
    cwd: Path | None = None,
    own_group: bool = True,
    preexec_fn: Callable[[], None] | None = interruptible,
) -> ProcessHandle:
    """Starts `command` with its output appended to `log_path`; `own_group=False` keeps it in this process's
    group (a kill of this process reaches it). `preexec_fn` runs in the child (default: `interruptible`)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")  # The child keeps its own descriptor; ours closes at once.
    try:
        process = subprocess.Popen(
            [str(word) for word in command],
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=own_group,
            preexec_fn=preexec_fn,
        )
    finally:
        log.close()
    return ProcessHandle(process, log_path, env, own_group=own_group)


def wait_until(handle: ProcessHandle, ready: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls `ready()` until it is true. RuntimeError if the process exits first; after `timeout` seconds the
    process is stopped and TimeoutError raised. Both carry the end of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not handle.alive():
            raise RuntimeError(f"{what} exited with {handle.process.returncode}:\n{handle.logs()[-4000:]}")
        if ready():
            return
        time.sleep(0.5)
    handle.stop()
    raise TimeoutError(f"{what} did not start within {timeout:.0f}s:\n{handle.logs()[-4000:]}")


def http_problem(url: str, expect: str | None = None) -> str:
    """Why `url` does not answer 200 (with `expect` in its body), or "" when it does."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read().decode("utf-8", errors="replace")
            if response.status == 200 and (expect is None or expect in body):
                return ""
            return f"HTTP {response.status}: {body[:200]}"
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
        return str(error) or type(error).__name__


def wait_for_http(
    url: str, handle: ProcessHandle, timeout: float, expect: str | None = None, what: str = "server"
) -> None:
    """Polls `url` until it answers 200 (and contains `expect`); fails early if the process died."""
    problem = ""

    def answers() -> bool:
        nonlocal problem
        problem = http_problem(url, expect)
        return not problem

    try:
        wait_until(handle, answers, timeout, what)
    except TimeoutError:
        raise TimeoutError(f"{url} not ready after {timeout:.0f}s ({problem}):\n{handle.logs()[-4000:]}") from None


def run_cli(
    args: Sequence[str], env: dict[str, str], *, cwd: Path = REPO_ROOT, timeout: float = 300.0, check: bool = True
) -> subprocess.CompletedProcess:
    """Runs a CLI (`prefect ...`, `mlflow ...`, `python ...`: this venv's) to completion; raises with its
    output on failure."""
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
