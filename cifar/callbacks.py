"""Keras callbacks of the training stage.

Order matters: Keras calls `on_epoch_end` in list order with one shared `logs` dict, so
`EpochStatistics` adds throughput and the learning rate first, `DivergenceGuard` stops a
diverged run before anything is written, `EpochCheckpoint` makes the epoch durable, and only then
`MetricsLogger` (MLflow) and `EpochProgress` report it. A crash between the checkpoint and the
report loses no epoch: the resumed run back-fills what was not reported (see `cifar.train`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from cifar import compat, failpoints
from cifar.checkpoints import (
    CheckpointEntry,
    CheckpointIndex,
    PartialEpoch,
    append_epoch,
    checkpoint_file_names,
    partial_checkpoint_name,
    remove_unlisted,
    save_file,
    updated_index,
    write_index,
)
from cifar.io import atomic_write_json
from cifar.preemption import TrainingPreempted

logger = logging.getLogger(__name__)

NAN_CHECK_EVERY = 20  # Batches between divergence checks inside an epoch (each check syncs the device).
LOOKAHEAD_BASE_DECAY = 0.95  # airbench94's lookahead decay per step (`Lookahead`).


class TrainingDivergedError(RuntimeError):
    """The training loss became NaN or infinite; nothing of the bad epoch was saved."""


def float_logs(logs: dict | None) -> dict[str, float]:
    """Keras logs as plain floats."""
    return {key: float(np.asarray(value)) for key, value in (logs or {}).items()}


def current_learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    """The learning rate of the optimizer's last step (a schedule evaluated at that step)."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    schedule = compat.learning_rate_schedule(optimizer)
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        last_step = max(0, int(np.asarray(optimizer.iterations)) - 1)
        return float(np.asarray(schedule(last_step)))
    return float(np.asarray(optimizer.learning_rate))


class EpochStatistics(keras.callbacks.Callback):
    """Adds `examples_per_second` (training steps only, after the first) and `learning_rate` to logs.

    Like the estimator's ExamplesPerSecondHook: the clock starts after the first step of the epoch,
    so graph tracing and XLA compilation do not count, and stops before validation.
    """

    def __init__(self, global_batch_size: int):
        super().__init__()
        self.global_batch_size = global_batch_size
        self._start: float | None = None
        self._end: float | None = None
        self._steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.perf_counter()
        self._start, self._end, self._steps = None, None, 0

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self._start is None:
            self._start = now
        else:
            self._steps += 1
            self._end = now

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        if self._steps and self._end > self._start:
            logs["examples_per_second"] = self._steps * self.global_batch_size / (self._end - self._start)
        elif self._start is not None:
            # A one-step epoch: only the whole step (tracing included) can be timed.
            logs["examples_per_second"] = self.global_batch_size / max(self._start - self._epoch_start, 1e-9)
        logs["learning_rate"] = current_learning_rate(self.model.optimizer)
        logs["epoch_seconds"] = time.perf_counter() - self._epoch_start  # Wall time, validation included.


class DivergenceGuard(keras.callbacks.Callback):
    """Raises TrainingDivergedError as soon as the training (or validation) loss is NaN or infinite."""

    def __init__(self, check_every: int = NAN_CHECK_EVERY):
        super().__init__()
        self.check_every = check_every

    def _check(self, loss, where: str) -> None:
        if loss is not None and not math.isfinite(float(np.asarray(loss))):
            self.model.stop_training = True
            raise TrainingDivergedError(
                f"loss became {float(np.asarray(loss))} at {where}; lower the learning rate "
                "(nothing from this epoch was checkpointed)"
            )

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.check_every == 0:
            self._check((logs or {}).get("loss"), f"step {batch + 1} of the epoch")

    def on_epoch_end(self, epoch, logs=None):
        # A finite but huge training loss can already give NaN logits on validation: both count.
        for key in ("loss", "val_loss"):
            self._check((logs or {}).get(key), f"the end of epoch {epoch + 1} ({key})")


class Lookahead(keras.callbacks.Callback):
    """airbench94's lookahead: every `every` steps the weights are pulled toward a slow copy.

    From `start_fraction` of the run on (airbench: epoch 3 of 9.9), at every optimizer step k that
    is a multiple of `every` the slow copy becomes `decay * slow + (1 - decay) * weights` with
    `decay = LOOKAHEAD_BASE_DECAY**every * (k / total_steps)**3`, and the weights are set to it: little
    averaging at first, strong averaging (decay ~0.77) of the noisy last steps. After the last step
    of every epoch the weights are set to the slow copy, so every checkpoint (and the final model)
    holds the slow weights and a resumed run restarts the slow copy exactly. Every float weight
    takes part, batch-norm statistics included.
    """

    def __init__(self, every: int, steps_per_epoch: int, total_steps: int, *, start_fraction: float = 0.3):
        super().__init__()
        if every < 1 or steps_per_epoch < 1 or total_steps < 1:
            raise ValueError(
                f"every, steps_per_epoch and total_steps must be >= 1, got {every}, {steps_per_epoch} and {total_steps}"
            )
        self.every = int(every)
        self.steps_per_epoch = int(steps_per_epoch)
        self.total_steps = int(total_steps)
        self.start_step = int(round(start_fraction * total_steps))
        self._slow: list = []
        self._weights: list = []
        self._started = False

    def decay_at(self, step: int) -> float:
        """The slow copy's decay at optimizer step `step` (0 before the start: it copies the weights)."""
        if step < self.start_step:
            return 0.0
        return LOOKAHEAD_BASE_DECAY**self.every * (step / self.total_steps) ** 3

    def on_train_begin(self, logs=None):
        import tensorflow as tf

        self._weights = [weight for weight in self.model.weights if "float" in str(weight.dtype)]
        self._slow = [tf.Variable(tf.convert_to_tensor(weight), trainable=False) for weight in self._weights]
        # A resumed run restarts from a checkpoint, which holds the slow weights (see on_train_batch_end).
        self._started = int(np.asarray(self.model.optimizer.iterations)) >= self.start_step

        @tf.function
        def update(decay):
            for slow, weight in zip(self._slow, self._weights):
                blended = slow * decay + tf.convert_to_tensor(weight) * (1.0 - decay)
                slow.assign(blended)
                weight.assign(blended)

        self._update = update

    def on_train_batch_end(self, batch, logs=None):
        step = int(np.asarray(self.model.optimizer.iterations))
        if step >= self.start_step and step % self.every == 0:
            self._update(np.float32(self.decay_at(step)))
            self._started = True
        if self._started and (step % self.steps_per_epoch == 0 or step == self.total_steps):
            self._update(np.float32(1.0))  # The epoch ends on the slow weights.


@contextlib.contextmanager
def ema_weights(model: keras.Model):
    """Temporarily puts the optimizer's EMA weights into the model (no-op without EMA)."""
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)  # Unwrap a LossScaleOptimizer.
    found = compat.ema_variables(optimizer)
    if found is None:
        yield
        return
    variables, averages = found
    raw = [np.asarray(variable.numpy()) for variable in variables]
    for variable, average in zip(variables, averages):
        variable.assign(average.numpy())
    try:
        yield
    finally:
        for variable, value in zip(variables, raw):
            variable.assign(value)


def batch_norm_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers of `model` that keep moving batch statistics (Keras's BatchNormalization and ours)."""
    return [layer for layer in model.layers if hasattr(layer, "moving_mean") and hasattr(layer, "moving_variance")]


def batch_norm_recomputer(model: keras.Model) -> Callable[[tf.data.Dataset], int] | None:
    """A function that sets every batch norm's moving statistics to the mean and variance of its input over
    the batches it is given, and returns how many images it used; None for a model without batch norm.

    "Precise BN" (Wu & Johnson 2021, "Rethinking 'Batch' in BatchNorm"): the inputs are computed in
    training mode, as the layers see them while they train, and each layer gets the population mean and
    variance over all the images.
    """
    layers = batch_norm_layers(model)
    if not layers:
        return None
    # A view of the functional model that returns every batch norm's input (each layer is called once).
    probe = keras.Model(model.inputs, [layer.input for layer in layers])

    @tf.function(reduce_retracing=True)
    def moments(images):
        # Training mode: batch statistics, as in training (it also moves the moving statistics, which are
        # overwritten below). Per layer: positions (images x height x width), per-channel sums and squares.
        outputs = [tf.cast(output, tf.float32) for output in probe(images, training=True)]
        values = [tf.reshape(output, [-1, output.shape[-1]]) for output in outputs]
        return [
            (tf.cast(tf.shape(x)[0], tf.float32), tf.reduce_sum(x, 0), tf.reduce_sum(tf.square(x), 0)) for x in values
        ]

    def recompute(batches: tf.data.Dataset) -> int:
        totals, images = None, 0
        for batch, _ in batches:
            sums = moments(batch)
            totals = sums if totals is None else [tuple(map(tf.add, old, new)) for old, new in zip(totals, sums)]
            images += int(batch.shape[0])
        if totals is None:
            raise ValueError("no images to recompute the batch-norm statistics from")
        for layer, (count, total, squares) in zip(layers, totals):
            mean = total / count
            layer.moving_mean.assign(mean)
            # E[x^2] - E[x]^2 in float32 over 10^5-10^6 positions, clipped at 0 against round-off.
            layer.moving_variance.assign(tf.maximum(squares / count - tf.square(mean), 0.0))
        return images

    return recompute


class PreciseBatchNorm(keras.callbacks.Callback):
    """Before each validation, recomputes the batch-norm statistics from training images (`train.precise_bn_images`).

    The moving averages trail the weights: at the ResNet recipes' momentum 0.997 they average the last
    ~330 steps, over which early training at rate 0.1 moves the weights far, and 55 stale layers
    compound into a validation at chance for the first epochs. Training normalises with each batch's
    own statistics, so this changes what validation, the checkpoints and the export see, never a
    gradient. Runs after `SwapEMAWeights`, so with EMA the statistics are those of the EMA weights.
    """

    def __init__(self, batches: tf.data.Dataset):
        super().__init__()
        self.batches = batches
        self._recompute: Callable[[tf.data.Dataset], int] | None = None

    def on_train_begin(self, logs=None):
        self._recompute = batch_norm_recomputer(self.model)

    def on_test_begin(self, logs=None):
        if self._recompute is not None:
            self._recompute(self.batches)


class EpochCheckpoint(keras.callbacks.Callback):
    """Writes the checkpoint contract of `cifar.checkpoints` after every epoch.

    Each epoch: `epoch-NNNN.keras` (raw weights + optimizer state, for resume) and
    `epoch-NNNN.eval.weights.h5` (EMA weights when EMA is on), each under a temp name renamed
    into place; then `history.json`; then `index.json` (the commit point: an epoch counts as done
    once the index lists it); then older checkpoints beyond the last `keep` and the best are
    deleted. Non-chief workers pass `write_records=False` and a temporary directory.
    """

    def __init__(
        self,
        checkpoint_dir: str | Path,
        *,
        keep: int,
        index: CheckpointIndex,
        history: dict[str, list[float]],
        history_path: str | Path | None,
        write_records: bool = True,
    ):
        super().__init__()
        self.checkpoint_dir = Path(checkpoint_dir)
        self.keep = keep
        self.index = index
        self.history = history
        self.history_path = Path(history_path) if history_path else None
        self.write_records = write_records

    def on_train_begin(self, logs=None):
        # Half-written files of a killed process are never listed in the index: remove them.
        remove_unlisted(self.checkpoint_dir, self.index)

    def on_epoch_end(self, epoch, logs=None):
        completed = epoch + 1  # Keras counts from 0; the contract counts completed epochs.
        metrics = float_logs(logs)
        model_name, weights_name = checkpoint_file_names(completed)
        save_file(self.checkpoint_dir / model_name, self.model.save)
        with ema_weights(self.model):
            save_file(self.checkpoint_dir / weights_name, self.model.save_weights)
        # Every worker keeps the records in memory; only the chief writes them.
        append_epoch(self.history, completed, metrics)
        entry = CheckpointEntry(epoch=completed, model_path=model_name, eval_weights_path=weights_name, metrics=metrics)
        self.index = updated_index(self.index, entry, self.keep)
        if self.write_records:
            if self.history_path is not None:
                atomic_write_json(self.history_path, self.history)
            write_index(self.checkpoint_dir, self.index)
        remove_unlisted(self.checkpoint_dir, self.index)
        failpoints.reached("train.epoch", completed)  # Committed, not yet reported to MLflow: a resume back-fills it.

    def save_partial(self, epoch: int, step: int, metric_values: list[list[float]], seconds: float) -> PartialEpoch:
        """Writes the state after `step` steps of epoch `epoch` (a stop mid-epoch), committed in the index."""
        model_name = partial_checkpoint_name(epoch, step)
        save_file(self.checkpoint_dir / model_name, self.model.save)
        partial = PartialEpoch(
            epoch=epoch, step=step, model_path=model_name, metric_values=metric_values, seconds=seconds
        )
        self.index = self.index.model_copy(update={"partial": partial})
        if self.write_records:
            write_index(self.checkpoint_dir, self.index)
        remove_unlisted(self.checkpoint_dir, self.index)  # An older partial state of the same epoch.
        return partial


class SaveOnSigterm(keras.callbacks.Callback):
    """After every training step, lets TF's handler save and stop when a SIGTERM arrived (here or on any worker).

    TF's `tf.distribute.experimental.PreemptionCheckpointHandler` watches the signal and, in a cluster,
    agrees with every worker on the step to save after (through the coordination service); its `save_fn`
    writes our contract (`EpochCheckpoint.save_partial`) and its `exit_fn` raises `TrainingPreempted`.
    Keras 3 has no preemption support of its own (its `BackupAndRestore` lost tf.keras'
    `save_before_preemption`), so the handler is asked here, once per step. The callback also continues a
    `resumed` partial epoch: its running training metrics are merged back after the first step (they are
    sums: Keras' `Mean` keeps a total and a count), and its earlier wall time is added to the epoch's
    `epoch_seconds`. Runs after `EpochStatistics` and `Lookahead`, before the epoch's checkpoint.
    """

    def __init__(
        self, checkpointer: EpochCheckpoint, steps_per_epoch: int, resumed: PartialEpoch | None, cluster_resolver=None
    ):
        super().__init__()
        self.checkpointer = checkpointer
        self.steps_per_epoch = steps_per_epoch
        self.resumed = resumed
        self.cluster_resolver = cluster_resolver
        self.handler = None  # TF's handler while `watching`; None outside the main thread (no signals there).
        self.epoch = 0  # 1-based: the epoch in progress.
        self.steps_done = 0  # Its completed steps, a resumed epoch's earlier ones included.
        self.stop_after_epoch = False  # The handler asked for a save at an epoch's last step.

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """TF's handler owns SIGTERM for the block (the fits); the previous handler (Prefect's) comes back after.

        A save asked for at an epoch's last step lets the epoch finish and commit, then raises here.
        """
        if threading.current_thread() is not threading.main_thread():
            logger.info("training outside the main thread: SIGTERM is not watched")
            yield
            return
        previous = signal.getsignal(signal.SIGTERM)
        config = tf.distribute.experimental.TerminationConfig(exit_fn=self._stop, save_fn=self._save, grace_period=0)
        self.handler = compat.preemption_handler(self.cluster_resolver, self.checkpointer.checkpoint_dir, config)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
        # The handler's save came at an epoch's last step (the epoch's own checkpoint was then its save),
        # or the signal came after the last step, which the handler never acts on: stop here.
        if self.stop_after_epoch or compat.preemption_signalled(self.handler):
            raise TrainingPreempted(
                f"training stopped by SIGTERM after epoch {self.epoch} (checkpointed); "
                "run the same command again to resume from there"
            )

    def _resuming(self) -> bool:
        return self.resumed is not None and self.resumed.epoch == self.epoch

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch + 1
        self.steps_done = self.resumed.step if self._resuming() else 0
        self._epoch_start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._resuming() and batch == 0:
            for variable, values in zip(self.model.metrics_variables, self.resumed.metric_values):
                variable.assign(variable + np.reshape(np.asarray(values, dtype=variable.dtype), variable.shape))
        self.steps_done += 1
        if self.handler is not None:
            compat.save_if_preempted(self.handler)  # Saves (`_save`) and stops (`_stop`) once asked to.

    def on_epoch_end(self, epoch, logs=None):
        if self._resuming():
            if logs is not None and "epoch_seconds" in logs:
                logs["epoch_seconds"] += self.resumed.seconds
            self.resumed = None

    def _seconds(self) -> float:
        return time.perf_counter() - self._epoch_start + (self.resumed.seconds if self._resuming() else 0.0)

    def _save(self) -> None:
        if self.steps_done >= self.steps_per_epoch:
            return  # The epoch's last step: its validation and checkpoint follow at once (`_stop`).
        metric_values = [np.asarray(variable).ravel().tolist() for variable in self.model.metrics_variables]
        self.checkpointer.save_partial(self.epoch, self.steps_done, metric_values, self._seconds())
        logger.info("SIGTERM: saved the state after step %d of epoch %d", self.steps_done, self.epoch)

    def _stop(self) -> None:
        if self.steps_done >= self.steps_per_epoch:
            self.model.stop_training = True  # Keras validates and commits this epoch, then `watching` raises.
            self.stop_after_epoch = True
            return
        raise TrainingPreempted(
            f"training stopped by SIGTERM and saved after step {self.steps_done} of {self.steps_per_epoch} "
            f"in epoch {self.epoch}; run the same command again to resume from there"
        )


class MetricsLogger(keras.callbacks.Callback):
    """Logs every epoch's metrics to the pipeline's MLflow run with step = the epoch number."""

    def __init__(self, log: Callable[[int, dict[str, float]], None]):
        super().__init__()
        self.log = log

    def on_epoch_end(self, epoch, logs=None):
        self.log(epoch + 1, float_logs(logs))


class EpochProgress(keras.callbacks.Callback):
    """Reports `{"epoch", "epochs", "seconds_left", **metrics}` to a plain function after every epoch: the time
    left at this attempt's typical epoch (cifar.estimate.epoch_seconds_median), when EpochStatistics timed it."""

    def __init__(self, report: Callable[[dict], None], epochs: int):
        super().__init__()
        self.report = report
        self.epochs = epochs
        self.seconds: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        from cifar.estimate import epoch_seconds_median

        report = {"epoch": epoch + 1, "epochs": self.epochs, **float_logs(logs)}
        if logs and logs.get("epoch_seconds"):
            self.seconds.append(float(logs["epoch_seconds"]))
            report["seconds_left"] = epoch_seconds_median(self.seconds) * (self.epochs - epoch - 1)
        self.report(report)
