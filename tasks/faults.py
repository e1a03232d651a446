"""Fault injection for drills and crash tests, switched on by environment variables; unset in production.

- `CIFAR_FAULT_AFTER_EPOCH=N`: the training task raises right after epoch N was reported (its
  checkpoint is already on disk), as a crash mid-training would.
- Kills of the whole process group at named points: `cifar.failpoints` (`CIFAR_KILL_AT`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

FAULT_AFTER_EPOCH_ENV = "CIFAR_FAULT_AFTER_EPOCH"


class InjectedFault(RuntimeError):
    """The failure CIFAR_FAULT_AFTER_EPOCH asked for."""


def after_epoch(report: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """Wraps a per-epoch callback so it raises after the epoch CIFAR_FAULT_AFTER_EPOCH names."""
    fault_after = os.environ.get(FAULT_AFTER_EPOCH_ENV)

    def on_epoch(progress: dict[str, Any]) -> None:
        report(progress)
        if fault_after and int(progress["epoch"]) >= int(fault_after):
            raise InjectedFault(f"{FAULT_AFTER_EPOCH_ENV}={fault_after}: failing after epoch {progress['epoch']}")

    return on_epoch
