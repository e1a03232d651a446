"""A training stopped by SIGTERM (`docker stop`, a Kubernetes eviction, `kill PID`): what it reports, how it exits.

`cifar.callbacks.SaveOnSigterm` does the work with TF's `PreemptionCheckpointHandler`: it saves the state
mid-epoch (`cifar.checkpoints.PartialEpoch`) and raises `TrainingPreempted`; a re-run continues the epoch
from the next step. Free of TensorFlow, so the command line's supervisor can import it.
"""

from __future__ import annotations

import signal

STOPPED_EXIT_CODE = 128 + signal.SIGTERM  # What a shell reports for a process ended by SIGTERM: 143.


class TrainingPreempted(RuntimeError):
    """Training stopped on SIGTERM after saving its state; running the same command again resumes it."""
