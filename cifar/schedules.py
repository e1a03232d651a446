"""Learning-rate schedules as serializable Keras `LearningRateSchedule`s, looked up by name.

Every schedule is a function of the optimizer step and knows the run's length in steps, so the same
config means the same curve whatever the batch size; the configured rate is the peak at batch size
128, scaled linearly with the batch (`scaled_learning_rate`, Goyal et al., 2017).
"""

from __future__ import annotations

import math

import keras
from keras import ops

from cifar.config import TrainConfig

REFERENCE_BATCH_SIZE = 128  # The configured learning rate is the peak at this batch size.
# The cifar10_estimator's ResNet recipe decayed at epochs 82 and 123 (and 300, past the end) of a ~164-epoch
# run: its fractions of the configured epochs, the last drop put at 150/164 so a run reaches the 0.002 stage.
PIECEWISE_FRACTIONS = (82 / 164, 123 / 164, 150 / 164)  # Where the estimator recipe decays.
PIECEWISE_MULTIPLIERS = (1.0, 0.1, 0.01, 0.002)


def scaled_learning_rate(learning_rate: float, batch_size: int) -> float:
    """The linear scaling rule: the peak learning rate for `batch_size` examples per step."""
    return learning_rate * batch_size / REFERENCE_BATCH_SIZE


def _warmup_factor(step, warmup_steps: int):
    """Ramps linearly from 1/warmup_steps to 1 over the warm-up, then stays at 1."""
    if warmup_steps <= 0:
        return ops.ones_like(step)
    return ops.minimum(1.0, (step + 1.0) / float(warmup_steps))


@keras.saving.register_keras_serializable(package="cifar")
class WarmupPiecewise(keras.optimizers.schedules.LearningRateSchedule):
    """Piecewise-constant multipliers of a peak rate at step boundaries, after a linear warm-up."""

    def __init__(self, peak: float, boundaries: list[int], multipliers: list[float], warmup_steps: int = 0):
        if len(multipliers) != len(boundaries) + 1:
            raise ValueError("piecewise schedule needs one more multiplier than boundaries")
        self.peak = float(peak)
        self.boundaries = [int(boundary) for boundary in boundaries]
        self.multipliers = [float(multiplier) for multiplier in multipliers]
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        multiplier = ops.full_like(step, self.multipliers[0])
        for boundary, value in zip(self.boundaries, self.multipliers[1:]):
            multiplier = ops.where(step >= boundary, value, multiplier)
        return self.peak * multiplier * _warmup_factor(step, self.warmup_steps)

    def get_config(self) -> dict:
        return {name: getattr(self, name) for name in ("peak", "boundaries", "multipliers", "warmup_steps")}


class _PeakOverRunSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule given by its peak rate, the run's length in steps and the warm-up steps."""

    def __init__(self, peak: float, total_steps: int, warmup_steps: int = 0):
        self.peak = float(peak)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)

    def get_config(self) -> dict:
        return {"peak": self.peak, "total_steps": self.total_steps, "warmup_steps": self.warmup_steps}


@keras.saving.register_keras_serializable(package="cifar")
class WarmupCosine(_PeakOverRunSchedule):
    """Linear warm-up to the peak, then cosine decay to 0 at `total_steps`."""

    def __call__(self, step):
        step = ops.cast(step, "float32")
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = ops.clip((step - self.warmup_steps) / decay_steps, 0.0, 1.0)
        cosine = 0.5 * (1.0 + ops.cos(math.pi * progress))
        return self.peak * ops.where(step < self.warmup_steps, _warmup_factor(step, self.warmup_steps), cosine)


@keras.saving.register_keras_serializable(package="cifar")
class OneCycle(_PeakOverRunSchedule):
    """Triangular one-cycle: linear from `initial_factor` x peak to the peak over the warm-up, then
    linear down to `final_factor` x peak at `total_steps` (both factors 0 by default; airbench94: from
    0.2 up to 1 over the first 23% of the steps, then down to 0.07)."""

    def __init__(
        self,
        peak: float,
        total_steps: int,
        warmup_steps: int = 0,
        initial_factor: float = 0.0,
        final_factor: float = 0.0,
    ):
        super().__init__(peak, total_steps, warmup_steps)
        if not (0.0 <= initial_factor <= 1.0 and 0.0 <= final_factor <= 1.0):
            raise ValueError(f"one-cycle factors must be in [0, 1], got {initial_factor} and {final_factor}")
        self.initial_factor = float(initial_factor)
        self.final_factor = float(final_factor)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        rising = (step + 1.0) / max(1, self.warmup_steps)
        falling = (self.total_steps - step) / max(1, self.total_steps - self.warmup_steps)
        rising = self.initial_factor + (1.0 - self.initial_factor) * ops.clip(rising, 0.0, 1.0)
        falling = self.final_factor + (1.0 - self.final_factor) * ops.clip(falling, 0.0, 1.0)
        return self.peak * ops.where(step < self.warmup_steps, rising, falling)

    def get_config(self) -> dict:
        return {**super().get_config(), "initial_factor": self.initial_factor, "final_factor": self.final_factor}


def make_schedule(train: TrainConfig, steps_per_epoch: int) -> keras.optimizers.schedules.LearningRateSchedule:
    """`train.schedule`, its peak scaled to the batch size and its epochs converted to steps."""
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
    name, epochs = train.schedule, train.epochs
    peak = scaled_learning_rate(train.learning_rate, train.batch_size)
    total_steps = steps_per_epoch * epochs
    warmup_steps = int(round(train.warmup_epochs * steps_per_epoch))
    if warmup_steps >= total_steps and name in {"cosine", "onecycle"}:
        raise ValueError(f"warmup_epochs ({train.warmup_epochs}) must be shorter than the run ({epochs} epochs)")
    if name == "constant":
        return WarmupPiecewise(peak, [], [1.0], warmup_steps)
    if name == "piecewise":
        boundaries = [int(round(fraction * total_steps)) for fraction in PIECEWISE_FRACTIONS]
        return WarmupPiecewise(peak, boundaries, list(PIECEWISE_MULTIPLIERS), warmup_steps)
    if name == "cosine":
        return WarmupCosine(peak, total_steps, warmup_steps)
    if name == "onecycle":
        return OneCycle(peak, total_steps, warmup_steps, train.warmup_initial_factor, train.final_learning_rate_factor)
    raise ValueError(f"unknown schedule {name!r}: expected constant, piecewise, cosine or onecycle")
