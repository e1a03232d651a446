"""Named points inside the stages where a drill kills the whole process group, as a power cut would.

`CIFAR_KILL_AT=<point>` in the environment arms one point; unset (always, in production) nothing
happens. The crash tests use it to show that a run killed anywhere leaves state the next run repairs:

    before:<task>         just before a pipeline task starts (prepare, train, evaluate, export, register)
    data.converted        shards written into the temp directory, not yet renamed into place
    train.epoch           the first epoch's checkpoint committed, training not finished
    evaluate.scored       evaluation files written, the result not yet recorded
    export.saved          the SavedModel written into its temp directory, not yet published
    register.registered   the registry version created, the gate not yet decided
    ingest.stored         an addition stored under its digest, the new snapshot not yet recorded
"""

from __future__ import annotations

import os
import signal

KILL_AT_ENV = "CIFAR_KILL_AT"


def reached(point: str) -> None:
    """Kills this process group with SIGKILL when `CIFAR_KILL_AT` names `point`."""
    if os.environ.get(KILL_AT_ENV) == point:
        os.killpg(os.getpgrp(), signal.SIGKILL)
