"""The training optimizers: SGD with momentum per parameter group, and Muon on the conv filters.

`GroupedSGD` is Keras's SGD (same update and momentum buffer, so checkpoints and schedules behave the
same) plus the fast-CIFAR recipes' parameter groups; `ConvMuon` trains the convolution filters by Muon
(airbench94_muon), reaching airbench94's accuracy in about 20 % fewer epochs on the official CIFAR-10.
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
    unmatched variables use 1 (airbench trains batch-norm biases at 64x the rate of the weights).
    `stop_after_steps` maps a pattern to the number of optimizer steps the matching variables train
    for (airbench trains the whitening bias for the first 3 epochs only); a stopped variable is left
    exactly where it is, neither its gradient nor its momentum moves it, as PyTorch's
    `requires_grad = False`.
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


# Muon's quintic Newton-Schulz iteration (Keller Jordan, airbench94_muon / modded-nanogpt): coefficients
# chosen for the steepest slope at zero, so 3 steps already push every singular value of a normalised
# matrix into roughly [0.7, 1.2]. Not exactly 1: the records found that this does not hurt.
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NEWTON_SCHULZ_STEPS = 3  # airbench94_muon's count; each step is three matrix products.
NEWTON_SCHULZ_EPSILON = 1e-7  # Keeps an all-zero direction (a frozen filter's) at zero instead of NaN.
FILTER_NORM_EPSILON = 1e-7


def is_conv_filter(variable) -> bool:
    """True for a 2-D convolution kernel (rank 4: height, width, input channels, filters), which Muon trains."""
    return len(variable.shape) == 4


def orthogonalise(matrix, steps: int = NEWTON_SCHULZ_STEPS):
    """The Newton-Schulz approximation of U V^T for `matrix` = U S V^T (any 2-D shape), in float32.

    The iteration runs in bfloat16, as the record does: its products tolerate the rounding (every
    step re-applies the same polynomial) and it is where the optimizer spends its time. The
    matrix is scaled to unit Frobenius norm first, so its largest singular value is at most 1,
    inside the interval where the polynomial converges.
    """
    matrix = ops.convert_to_tensor(matrix, "float32")
    rows, columns = matrix.shape
    first, second, third = NEWTON_SCHULZ_COEFFICIENTS
    x = ops.cast(matrix / (ops.sqrt(ops.sum(ops.square(matrix))) + NEWTON_SCHULZ_EPSILON), "bfloat16")
    transposed = rows > columns
    if transposed:
        x = ops.transpose(x)  # (short side, long side): the Gram matrix below is the small one.
    for _ in range(steps):
        gram = ops.matmul(x, ops.transpose(x))  # (short, short)
        polynomial = second * gram + third * ops.matmul(gram, gram)
        x = first * x + ops.matmul(polynomial, x)
    if transposed:
        x = ops.transpose(x)
    return ops.cast(x, "float32")


def renormalised(kernel):
    """`kernel` (H, W, C_in, filters) rescaled so its filters have unit root-mean-square norm.

    Its Frobenius norm becomes sqrt(filters), as airbench94_muon does (one factor for the whole
    kernel: filters keep their relative sizes). Batch norm follows every filter, so the scale does
    not change what the network computes; it fixes the size of Muon's steps relative to the weights,
    which no weight decay has to hold in check.
    """
    filters = kernel.shape[-1]
    return kernel * (filters**0.5 / (ops.sqrt(ops.sum(ops.square(kernel))) + FILTER_NORM_EPSILON))


@keras.saving.register_keras_serializable(package="cifar")
class ConvMuon(GroupedSGD):
    """Muon on every convolution filter, `GroupedSGD` on everything else (airbench94_muon's split).

    A filter's step, with `muon_momentum` m and learning rate `lr` (the schedule's rate times
    `muon_learning_rate_multiplier`):

        buffer    <- m * buffer + gradient                           # PyTorch's momentum buffer
        direction  = gradient + m * buffer   (Nesterov; else buffer)
        kernel    <- renormalised(kernel) - lr * orthogonalise(direction as a (H*W*C_in, filters) matrix)

    The direction's scale drops out (the iteration normalises it), so `lr` is the size of the step
    itself, not a multiple of the gradient: it is not scaled with the batch size, and the loss's
    scale (mean or sum) does not matter. The reshape keeps each filter one column; the order of
    the rows does not change the result. Keras's `keras.optimizers.Muon` is not this: it routes
    4-D kernels to AdamW.

    Every variable has one slot, "momentum": SGD's buffer (Keras's convention) for the others,
    Muon's for the filters, so checkpoints and EMA behave as with `GroupedSGD`. The groups of
    `GroupedSGD` (multipliers, stop steps) apply to the non-filter variables only.
    """

    def __init__(
        self,
        learning_rate=0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        muon_learning_rate_multiplier: float = 1.0,
        muon_momentum: float = 0.6,
        newton_schulz_steps: int = NEWTON_SCHULZ_STEPS,
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, **kwargs)
        if muon_learning_rate_multiplier <= 0:
            raise ValueError(f"muon_learning_rate_multiplier must be > 0, got {muon_learning_rate_multiplier}")
        if not 0 <= muon_momentum < 1:
            raise ValueError(f"muon_momentum must be in [0, 1), got {muon_momentum}")
        if newton_schulz_steps < 1:
            raise ValueError(f"newton_schulz_steps must be >= 1, got {newton_schulz_steps}")
        self.muon_learning_rate_multiplier = float(muon_learning_rate_multiplier)
        self.muon_momentum = float(muon_momentum)
        self.newton_schulz_steps = int(newton_schulz_steps)
        self._is_filter: list[bool] = []

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        if not self.momentums:  # SGD without momentum has no slots, but Muon's filters need theirs.
            self.momentums = self.add_optimizer_variables(variables, "momentum")
        self._is_filter = [is_conv_filter(variable) for variable in variables]

    def update_step(self, gradient, variable, learning_rate):
        index = compat.variable_index(self, variable)
        if not self._is_filter[index]:
            return super().update_step(gradient, variable, learning_rate)
        learning_rate = ops.cast(learning_rate, variable.dtype) * self.muon_learning_rate_multiplier
        gradient = ops.cast(gradient, variable.dtype)
        momentum = ops.cast(self.muon_momentum, variable.dtype)
        buffer = self.momentums[index]
        new_buffer = buffer * momentum + gradient
        self.assign(buffer, new_buffer)
        direction = gradient + momentum * new_buffer if self.nesterov else new_buffer
        shape = variable.shape
        update = ops.reshape(orthogonalise(ops.reshape(direction, (-1, shape[-1])), self.newton_schulz_steps), shape)
        self.assign(variable, renormalised(variable) - learning_rate * update)

    def get_config(self):
        return {
            **super().get_config(),
            "muon_learning_rate_multiplier": self.muon_learning_rate_multiplier,
            "muon_momentum": self.muon_momentum,
            "newton_schulz_steps": self.newton_schulz_steps,
        }
