"""Inter-process locks on shared workdir state: one owner at a time for a store, a run, a data key, an export.

A lock is `fcntl.flock` on a small file beside what it guards. The kernel drops it when its holder
exits, however it exits (SIGKILL included), so a crashed run never leaves a stale lock behind. The
file records who holds the lock (pid, host, since when), so a process that has to wait says for whom.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

logger = logging.getLogger("cifar.locks")


@contextlib.contextmanager
def exclusive(path: str | Path, what: str) -> Iterator[None]:
    """Holds the lock at `path` for the block, waiting (and saying so) while another process holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            logger.warning("Waiting for %s: another run holds it (%s)", what, handle.read().strip() or "unknown")
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.truncate(0)
            fcntl.flock(handle, fcntl.LOCK_UN)


_REENTRANT: dict[str, tuple[threading.RLock, list[int]]] = {}  # Lock path -> (thread lock, [depth]).
_REENTRANT_GUARD = threading.Lock()


@contextlib.contextmanager
def reentrant(path: str | Path, what: str) -> Iterator[None]:
    """`exclusive`, but a thread that already holds the lock at `path` may enter again (nested calls).

    Other threads of the process wait on a thread lock first, then the outermost holder takes the
    file lock that keeps other processes out.
    """
    key = str(Path(path).resolve())
    with _REENTRANT_GUARD:
        thread_lock, depth = _REENTRANT.setdefault(key, (threading.RLock(), [0]))
    with thread_lock:
        depth[0] += 1
        try:
            if depth[0] > 1:
                yield
            else:
                with exclusive(path, what):
                    yield
        finally:
            depth[0] -= 1


def is_held(path: str | Path) -> bool:
    """Whether a live process holds the lock at `path` (a missing lock file is not held)."""
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115  Closed below; `with` would hide the flow.
    except FileNotFoundError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def lock_path(target: Path, purpose: str = "lock") -> Path:
    """The lock guarding `target` = WORKDIR/<area>/<name>: WORKDIR/.locks/<area>/<name>.<purpose>.

    Kept out of the areas themselves, so `data/`, `runs/` and `export/` list only what they hold.
    """
    return target.parents[1] / ".locks" / target.parent.name / f"{target.name}.{purpose}"
