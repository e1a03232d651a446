"""The training optimizer: SGD with momentum whose learning rate can differ per parameter group.

`GroupedSGD` is Keras's SGD (same update, same momentum-buffer convention, so checkpoints and
schedules behave the same) plus two things the fast-CIFAR recipes need:

- a learning-rate multiplier per group of variables, chosen by a regular expression on the
  variable's path (airbench trains batch-norm biases at 64x the rate of the weights);
- groups that stop training after a given optimizer step (airbench trains the whitening layer's
  bias for the first 3 epochs only). A stopped variable is left exactly where it is: neither its
  gradient nor its momentum moves it any more, as with PyTorch's `requires_grad = False`.
"""

from __future__ import annotations

import re

import keras
from keras import ops

from cifar import compat


@keras.saving.register_keras_serializable(package="cifar")
class GroupedSGD(keras.optimizers.SGD):
    """SGD (with momentum / Nesterov) with per-group learning-rate multipliers and stop steps.

    `learning_rate_multipliers` maps a regular expression (matched with `re.search` against
    `variable.path`, e.g. "group1_bn1/beta") to a multiplier; the first matching pattern wins and
    unmatched variables use 1. `stop_after_steps` maps a pattern to the number of optimizer steps
    the matching variables train for.
    """

    def __init__(
        self,
        learning_rate=0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        learning_rate_multipliers: dict[str, float] | None = None,
        stop_after_steps: dict[str, int] | None = None,
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, **kwargs)
        multipliers = learning_rate_multipliers or {}
        self.learning_rate_multipliers = {str(key): float(value) for key, value in multipliers.items()}
        self.stop_after_steps = {str(key): int(value) for key, value in (stop_after_steps or {}).items()}
        for pattern, multiplier in self.learning_rate_multipliers.items():
            re.compile(pattern)
            if multiplier <= 0:
                raise ValueError(f"learning-rate multiplier for {pattern!r} must be > 0, got {multiplier}")
        for pattern, steps in self.stop_after_steps.items():
            re.compile(pattern)
            if steps < 0:
                raise ValueError(f"stop step for {pattern!r} must be >= 0, got {steps}")
        self._multipliers: list[float] = []
        self._stop_steps: list[int | None] = []

    @staticmethod
    def _first_match(table: dict, path: str):
        return next((value for pattern, value in table.items() if re.search(pattern, path)), None)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._multipliers = [self._first_match(self.learning_rate_multipliers, v.path) or 1.0 for v in variables]
        self._stop_steps = [self._first_match(self.stop_after_steps, v.path) for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        index = compat.variable_index(self, variable)
        multiplier, stop = self._multipliers[index], self._stop_steps[index]
        if multiplier == 1.0 and stop is None:
            return super().update_step(gradient, variable, learning_rate)
        learning_rate = ops.cast(learning_rate, variable.dtype) * multiplier
        gradient = ops.cast(gradient, variable.dtype)
        # 1 while the variable trains, 0 once it has stopped: scales the whole update below.
        active = ops.cast(ops.less(self.iterations, stop), variable.dtype) if stop is not None else None
        if self.momentum == 0:
            step = -gradient * learning_rate
            self.assign_add(variable, step if active is None else step * active)
            return
        momentum = ops.cast(self.momentum, variable.dtype)
        buffer = self.momentums[index]
        new_buffer = buffer * momentum - gradient * learning_rate
        if active is not None:
            new_buffer = new_buffer * active
        self.assign(buffer, new_buffer)
        step = new_buffer * momentum - gradient * learning_rate if self.nesterov else new_buffer
        self.assign_add(variable, step if active is None else step * active)

    def get_config(self):
        return {
            **super().get_config(),
            "learning_rate_multipliers": dict(self.learning_rate_multipliers),
            "stop_after_steps": dict(self.stop_after_steps),
        }
