"""Commands run by the stack check, each kept in its log with its output and exit status, secrets redacted."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class StepError(RuntimeError):
    """A step of the check that did not do what it must; its message goes into the table."""


class Shell:
    """Runs commands and writes each one, its output and its exit status to the log at `path` (owner-only)."""

    def __init__(self, path: Path):
        self.path = path
        self.handle = open(path, "w", encoding="utf-8")
        os.chmod(path, 0o600)
        self.secrets: list[str] = []

    def hide(self, secret: str) -> None:
        """`secret` is written as *** from now on."""
        self.secrets.append(secret)

    def write(self, text: str) -> None:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        self.handle.write(text)
        self.handle.flush()

    def run(
        self,
        argv: list,
        *,
        env: dict[str, str] | None = None,
        check: bool = True,
        timeout: float = 600,
        input: str | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """`argv` to completion; StepError when it exits non-zero (`check`) or outlasts `timeout` seconds."""
        argv = [str(word) for word in argv]
        started = time.monotonic()
        self.write(f"\n[{datetime.now():%H:%M:%S}] $ {shlex.join(argv)}\n")
        try:
            result = subprocess.run(
                argv, env=env, cwd=cwd, input=input, capture_output=True, text=True, timeout=timeout, errors="replace"
            )
        except subprocess.TimeoutExpired as error:
            self.write(f"{error.stdout or ''}{error.stderr or ''}[timed out after {timeout:.0f}s]\n")
            raise StepError(f"`{short(argv)}` did not finish in {timeout:.0f}s") from None
        self.write(f"{result.stdout}{result.stderr}[exit {result.returncode}, {time.monotonic() - started:.1f}s]\n")
        if check and result.returncode != 0:
            raise StepError(f"`{short(argv)}` exited {result.returncode}: {last_line(result.stderr or result.stdout)}")
        return result


def short(argv: list[str]) -> str:
    text = shlex.join(argv[:6]) + (" ..." if len(argv) > 6 else "")
    return text if len(text) < 140 else text[:137] + "..."


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def wait_until(what: str, probe: Callable[[], T], timeout: float, interval: float = 2.0) -> T:
    """Calls `probe()` until it returns something truthy; that value, or StepError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise StepError(f"{what}: not after {timeout:.0f}s")
        time.sleep(interval)
