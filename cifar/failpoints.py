"""Named points where a drill or a crash test makes a run fail: killed there, as a power cut would, or raising.

`CIFAR_KILL_AT=<point>` kills the whole process group at the point; `CIFAR_RAISE_AT=<point>` raises
`InjectedFault` there; `CIFAR_TERM_AT=<point>` sends SIGTERM to the parent process (the command line's
supervisor), as `kill PID` of the command would. `<point>:<N>` arms a counted point from its Nth time on.
Unset (always, in production), nothing happens. What each drill shows: docs/RELIABILITY.md.
"""

from __future__ import annotations

import os
import signal
import time

KILL_AT_ENV = "CIFAR_KILL_AT"
RAISE_AT_ENV = "CIFAR_RAISE_AT"
TERM_AT_ENV = "CIFAR_TERM_AT"
POINTS = {  # Where each point is reached; "counted" ones are reached with a number.
    "before:<task>": "just before a pipeline task starts (prepare, train, evaluate, export, register)",
    "data.converted": "shards written into the temp directory, not yet renamed into place",
    "train.epoch": "an epoch's checkpoint committed, not yet reported (counted: the epoch)",
    "train.reported": "an epoch reported to the training task's progress (counted: the epoch)",
    "evaluate.scored": "evaluation files written, the result not yet recorded",
    "export.saved": "the SavedModel written into its temp directory, not yet published",
    "register.registered": "the registry version created, the gate not yet decided",
    "ingest.stored": "an addition stored under its digest, the new snapshot not yet recorded",
}


class InjectedFault(RuntimeError):
    """The failure CIFAR_RAISE_AT asked for."""


def armed(value: str | None, point: str, count: int | None) -> bool:
    """Whether an environment value (`<point>` or `<point>:<N>`) arms `point`, reached for the `count`th time."""
    if not value:
        return False
    name, _, number = value.rpartition(":")
    if not number.isdigit():  # Not counted (`before:<task>` holds a colon of its own).
        name, number = value, ""
    return name == point and (not number or (count is not None and count >= int(number)))


def reached(point: str, count: int | None = None) -> None:
    """Kills this process group (CIFAR_KILL_AT), raises InjectedFault (CIFAR_RAISE_AT) or sends the parent
    SIGTERM (CIFAR_TERM_AT) when armed at `point`."""
    if armed(os.environ.get(KILL_AT_ENV), point, count):
        os.killpg(os.getpgrp(), signal.SIGKILL)
    if armed(os.environ.get(TERM_AT_ENV), point, count):
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(1)  # The supervisor forwards it to this process: it lands here, at a known point.
    if armed(value := os.environ.get(RAISE_AT_ENV), point, count):
        raise InjectedFault(
            f"{RAISE_AT_ENV}={value}: failing at {point}" + (f" ({count})" if count is not None else "")
        )
