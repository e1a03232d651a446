"""The Keras callback of a search trial: reports every epoch's validation accuracy and stops a hopeless run.

It runs after the epoch's checkpoint and metrics are written (`cifar.train` puts extra callbacks
last), so a pruned run keeps every epoch it trained: checkpoints, history, MLflow metrics. Stopping
is Keras's own `model.stop_training`, so `fit` returns normally and training ends "stopped" rather
than complete: it is never reused as finished, and a later run of the same settings resumes it.
"""

from __future__ import annotations

import logging

import keras

from cifar.config import TrialLink
from cifar.search.space import OBJECTIVE
from cifar.search.study import TrialReporter

logger = logging.getLogger("cifar.search")


class TrialPruning(keras.callbacks.Callback):
    """Reports `val_accuracy` at step = epoch (1-based) and stops training when the pruner says so."""

    def __init__(self, link: TrialLink, epochs: int) -> None:
        super().__init__()
        self.link = link
        self.epochs = epochs
        self.reporter = TrialReporter(link)
        self.pruned_after: int | None = None

    def on_epoch_end(self, epoch, logs=None):
        value = (logs or {}).get(OBJECTIVE)
        if value is None:
            return
        completed = epoch + 1
        # The last epoch is never pruned: the run is complete, and its value is the trial's result.
        if self.reporter.report(completed, float(value)) and completed < self.epochs:
            self.pruned_after = completed
            self.model.stop_training = True
            logger.info(
                "trial %d of %s pruned after epoch %d (%s %.4f)",
                self.link.number,
                self.link.study_name,
                completed,
                OBJECTIVE,
                float(value),
            )
