"""The training stage: `train(config, data_dir, workdir)` fits a model and checkpoints every epoch.

Recipe (the cifar10_estimator's, modernised): SGD with momentum (Nesterov per config), the
learning rate given for batch 128 and scaled linearly with the global batch size, one of the
schedules in `cifar.schedules`, optional label smoothing and weight EMA.

Weight decay is an L2 penalty added to the loss for conv/dense kernels only (not biases, not
batch-norm gamma/beta): `weight_decay / 2 * sum(w**2)`, whose gradient is `weight_decay * w`,
exactly the estimator's `weight_decay * tf.nn.l2_loss(w)` and PyTorch's SGD `weight_decay`.
We chose the loss penalty over the optimizer's decoupled `weight_decay` because decoupled decay
bypasses momentum (its effective strength differs by ~1/(1 - momentum)), so the estimator's and
the ResNet-9 recipes' published coefficients would not carry over. With `decay_biases` (the fast
recipes) every parameter is decayed, batch-norm biases by `weight_decay / bias_learning_rate_multiplier`, and
`cifar.optimizers.GroupedSGD` gives batch-norm biases their own rate and stops the whitening bias
after `whitening_bias_epochs`; `Lookahead` (cifar.callbacks) replaces EMA there.

Run directory `WORKDIR/runs/<run_name>/`: `checkpoints/` (contract in `cifar.checkpoints`),
`history.json` (one value per epoch and metric), `state.json` (the MLflow run id, the status and,
once complete, the result) and `training_curves.png`.

Resume semantics:
- `train.resume=True` (default) continues from the latest checkpoint in the index: model weights,
  optimizer state (momentum, step counter, EMA) and the epoch counter (`initial_epoch`) are
  restored, the history is cut to that epoch and the same MLflow run is continued. An epoch counts
  once `index.json` lists it, so after a crash or kill at any point no epoch is lost and none is
  counted twice; metrics MLflow missed (a kill between the checkpoint and the report) are
  back-filled, one value per epoch.
- A completed run re-invoked returns its stored `TrainResult` without training.
- `train.resume=False` (`--fresh`) deletes the old run directory and starts a new MLflow run.
- Multi-worker runs resume only when every worker sees the chief's run directory (shared disk).

A NaN or infinite loss raises `TrainingDivergedError`: the bad epoch is not checkpointed and the
MLflow run is marked FAILED.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import keras
import numpy as np
import pydantic
import tensorflow as tf

from cifar import distribute, schedules, tracking
from cifar.callbacks import (
    DivergenceGuard,
    EpochCheckpoint,
    EpochProgress,
    EpochStatistics,
    Lookahead,
    MetricsLogger,
    TrainingDivergedError,
)
from cifar.checkpoints import CheckpointIndex, load_index
from cifar.config import PipelineConfig, resolve_workdir
from cifar.data.manifest import Manifest, load_manifest
from cifar.input_pipeline import make_eval_dataset, make_train_dataset, split_size
from cifar.io import atomic_write_json, read_json
from cifar.layers import PatchWhitening
from cifar.models import build_model, init_whitening, input_size
from cifar.optimizers import GroupedSGD
from cifar.train_plots import plot_training_curves
from cifar.workdir import run_dir as run_dir_of
from cifar.workdir import stable_hash

try:  # Lands concurrently; training must work (in float32, no XLA) until it does.
    from cifar.performance import configure_performance
except ImportError:  # pragma: no cover
    configure_performance = None

__all__ = ["TrainResult", "TrainingDivergedError", "default_run_name", "train"]

logger = logging.getLogger(__name__)

STATE_NAME = "state.json"
HISTORY_NAME = "history.json"
PLOT_NAME = "training_curves.png"
# Fields that do not change what is trained, so they do not change the default run name.
RUN_NAME_EXCLUDED_FIELDS = ("resume", "run_name")


class TrainResult(pydantic.BaseModel):
    run_dir: str
    checkpoint_dir: str
    mlflow_run_id: str | None
    tracking_uri: str
    epochs_completed: int
    best_epoch: int | None
    val_accuracy: float | None  # Of the best epoch; None without a validation split.
    metrics: dict[str, float]  # The last epoch's metrics.
    model: str
    run_name: str


@keras.saving.register_keras_serializable(package="cifar")
class SparseCrossentropyWithSmoothing(keras.losses.Loss):
    """Cross-entropy from logits with integer labels and label smoothing (Keras' sparse loss has none)."""

    def __init__(self, label_smoothing: float = 0.0, num_classes: int = 10, name: str = "crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = float(label_smoothing)
        self.num_classes = int(num_classes)

    def call(self, y_true, y_pred):
        one_hot = keras.ops.one_hot(keras.ops.cast(keras.ops.reshape(y_true, [-1]), "int32"), self.num_classes)
        return keras.losses.categorical_crossentropy(
            one_hot, y_pred, from_logits=True, label_smoothing=self.label_smoothing
        )

    def get_config(self) -> dict:
        return {**super().get_config(), "label_smoothing": self.label_smoothing, "num_classes": self.num_classes}


def data_key(manifest: Manifest) -> str:
    """What identifies the prepared data: the archive's digest, the data settings, the format."""
    return stable_hash({"source_sha256": manifest.source.sha256, "settings": manifest.settings,
                        "format_version": manifest.format_version})


def default_run_name(config: PipelineConfig, data_key: str) -> str:
    """`<model>-<hash>` of the data, the train settings (except resume/run_name) and the seed."""
    train_fields = config.train.model_dump(exclude=set(RUN_NAME_EXCLUDED_FIELDS))
    return f"{config.train.model}-{stable_hash({'data': data_key, 'train': train_fields, 'seed': config.seed})}"


def training_splits(config: PipelineConfig, manifest: Manifest) -> tuple[list[str], list[str]]:
    """(splits to train on, splits to validate on); validation is empty when there is none."""
    has_validation = "validation" in manifest.splits and manifest.splits["validation"].num_examples > 0
    if config.train.use_all_training_data:
        return (["train", "validation"] if has_validation else ["train"]), []
    return ["train"], (["validation"] if has_validation else [])


def compute_steps_per_epoch(config: PipelineConfig, num_examples: int) -> int:
    """Full global batches per epoch, capped by `train.steps_per_epoch`."""
    full_batches = num_examples // config.train.batch_size
    if full_batches < 1:
        raise ValueError(
            f"batch_size {config.train.batch_size} is larger than the {num_examples} training examples"
        )
    cap = config.train.steps_per_epoch
    return min(full_batches, cap) if cap else full_batches


BATCH_NORM_BIAS_PATTERN = r"(^|/)beta$"  # Batch-norm biases (Keras's and ours are named "beta").
WHITENING_BIAS_PATTERN = r"(^|/)whitening/bias$"  # The fast net's PatchWhitening bias.


def add_weight_decay(model: keras.Model, weight_decay: float, *, decay_biases: bool = False,
                     bias_multiplier: float = 1.0) -> list[str]:
    """Puts an L2 penalty (gradient `weight_decay * w`) on every conv/dense kernel; returns their paths.

    With `decay_biases` every other trainable variable (biases, batch-norm beta/gamma) is decayed
    too, by `weight_decay / multiplier` where its learning rate is `multiplier` times the base: the
    product of rate and decay, i.e. how much of the weight each step removes, is then the same for
    every parameter (airbench's parameterisation).
    """
    if weight_decay <= 0:
        return []
    regularizer = keras.regularizers.L2(weight_decay / 2.0)
    bias_regularizer = keras.regularizers.L2(weight_decay / 2.0 / bias_multiplier)
    decayed = []
    for variable in model.trainable_variables:
        # Kernels of Conv/Dense/Depthwise/Separable layers; biases and BN gamma/beta only on request.
        if variable.name.endswith("kernel"):
            variable.regularizer = regularizer
        elif decay_biases:
            is_batch_norm_bias = re.search(BATCH_NORM_BIAS_PATTERN, variable.path) is not None
            variable.regularizer = bias_regularizer if is_batch_norm_bias else regularizer
        else:
            continue
        decayed.append(variable.path)
    return decayed


def make_optimizer(config: PipelineConfig, steps_per_epoch: int) -> GroupedSGD:
    """SGD with momentum on the configured schedule, with airbench's parameter groups when asked."""
    train = config.train
    schedule = schedules.make_schedule(
        train.schedule, learning_rate=train.learning_rate, batch_size=train.batch_size,
        steps_per_epoch=steps_per_epoch, epochs=train.epochs, warmup_epochs=train.warmup_epochs,
        initial_factor=train.warmup_initial_factor, final_factor=train.final_learning_rate_factor,
    )
    multipliers = {}
    if train.bias_learning_rate_multiplier != 1.0:
        multipliers[BATCH_NORM_BIAS_PATTERN] = train.bias_learning_rate_multiplier
    stops = {}
    if train.whitening_bias_epochs is not None:
        stops[WHITENING_BIAS_PATTERN] = int(round(train.whitening_bias_epochs * steps_per_epoch))
    return GroupedSGD(
        learning_rate=schedule, momentum=train.momentum, nesterov=train.nesterov,
        learning_rate_multipliers=multipliers, stop_after_steps=stops,
        use_ema=train.ema_decay is not None, ema_momentum=train.ema_decay or 0.99,
    )


def compile_model(model: keras.Model, config: PipelineConfig, steps_per_epoch: int, jit_compile: bool) -> None:
    train = config.train
    if train.label_smoothing > 0:
        loss = SparseCrossentropyWithSmoothing(train.label_smoothing)
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=make_optimizer(config, steps_per_epoch), loss=loss,
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")], jit_compile=jit_compile)


def _avoid_collective_shape_probe(model: keras.Model, strategy, batch_size: int, image_size: int) -> None:
    """Works around Keras 3.15 `fit` under MultiWorkerMirroredStrategy.

    Before training, Keras' TF trainer averages the first distributed batch across replicas
    (`strategy.reduce("MEAN", batch)`) only to learn the input shapes for building metrics and
    the optimizer; across workers that is a collective on uint8 images and fails
    ("Attempt to convert a value (PerReplica...)"). Shapes are all it needs, so this model
    builds from a zero batch of one replica's shape instead.
    """
    sample = (tf.zeros([batch_size, image_size, image_size, 3], tf.uint8), tf.zeros([batch_size], tf.int32))

    def symbolic_build(iterator=None, data_batch=None):
        with strategy.scope():
            model._symbolic_build(data_batch=sample)

    model._maybe_symbolic_build = symbolic_build


def _console_verbosity() -> int:
    """A live progress bar on a terminal, one line per epoch in logs."""
    return 1 if sys.stdout.isatty() else 2


def _discard_run(run_dir: Path) -> None:
    """Moves an old run aside, then deletes it (a crash midway never leaves a half-deleted run in place)."""
    if not run_dir.exists():
        return
    aside = run_dir.with_name(f".{run_dir.name}.discarded-{time.time_ns()}")
    run_dir.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


def _truncate_history(history: dict[str, list[float]], epochs: int) -> dict[str, list[float]]:
    """The history of the first `epochs` epochs (a kill may have recorded one the index does not list)."""
    if not history.get("epoch"):
        return {}
    keep = [position for position, epoch in enumerate(history["epoch"]) if epoch <= epochs]
    return {key: [values[position] for position in keep if position < len(values)] for key, values in history.items()}


def _history_rows(history: dict[str, list[float]]) -> list[tuple[int, dict[str, float]]]:
    """(epoch, metrics) per recorded epoch, leaving out metrics missing in that epoch."""
    rows = []
    for position, epoch in enumerate(history.get("epoch", [])):
        metrics = {key: values[position] for key, values in history.items()
                   if key != "epoch" and position < len(values) and values[position] is not None}
        rows.append((int(epoch), metrics))
    return rows


class _Run:
    """Where one training run keeps its files, and its MLflow bookkeeping in state.json."""

    def __init__(self, workdir: Path, run_name: str, tracking_uri: str):
        self.name = run_name
        self.directory = run_dir_of(workdir, run_name)
        self.checkpoint_dir = self.directory / "checkpoints"
        self.state_path = self.directory / STATE_NAME
        self.history_path = self.directory / HISTORY_NAME
        self.tracking_uri = tracking_uri

    def read_state(self) -> dict:
        return read_json(self.state_path) if self.state_path.is_file() else {}

    def write_state(self, run_id: str | None, status: str, result: TrainResult | None = None) -> None:
        state = {"run_name": self.name, "mlflow_run_id": run_id, "tracking_uri": self.tracking_uri, "status": status}
        if result is not None:
            state["result"] = result.model_dump()
        atomic_write_json(self.state_path, state)

    def read_history(self, epochs: int) -> dict[str, list]:
        """The recorded history of the first `epochs` epochs (a kill may have left one more)."""
        return _truncate_history(read_json(self.history_path), epochs) if self.history_path.is_file() else {}

    def result(self, config: PipelineConfig, run_id: str | None, index: CheckpointIndex, history) -> TrainResult:
        rows = _history_rows(history)
        best = index.best
        return TrainResult(
            run_dir=str(self.directory), checkpoint_dir=str(self.checkpoint_dir), mlflow_run_id=run_id,
            tracking_uri=self.tracking_uri, epochs_completed=index.latest.epoch if index.latest else 0,
            best_epoch=index.best_epoch, val_accuracy=best.metrics.get("val_accuracy") if best else None,
            metrics=rows[-1][1] if rows else {}, model=config.train.model, run_name=self.name,
        )


def _open_tracking(config, run: _Run, workdir, data_dir, manifest, history, extra_params, tags) -> str:
    """The pipeline's MLflow run id: the one in state.json if the store still has it, else a new one.

    A new run gets every config field as a param, the dataset as an input, the config and the
    manifest as artifacts. Epochs checkpointed but never reported (killed in between) are
    reported now, once each, so the metric history has one value per epoch (`history` holds
    only checkpointed epochs).
    """
    import mlflow

    run_id = run.read_state().get("mlflow_run_id")
    if not (run_id and tracking.run_exists(run.tracking_uri, run_id)):
        run_id = tracking.create_run(run.tracking_uri, workdir, config.tracking.experiment, run.name, tags)
        tracking.log_params(run.tracking_uri, run_id, {**config.flat(), **extra_params})
        with tracking.use_run(run.tracking_uri, run_id):
            mlflow.log_input(tracking.manifest_dataset(manifest, data_dir), context="training")
            mlflow.log_dict(config.model_dump(mode="json"), "config.json")
            mlflow.log_artifact(str(Path(data_dir) / "manifest.json"))
    client = mlflow.MlflowClient(tracking_uri=run.tracking_uri)
    for key in ("devices", *[key for key in tags if key.startswith("performance.")]):
        client.set_tag(run_id, key, tags[key])  # What this attempt ran on (a resume may differ).
    run.write_state(run_id, "running")
    logged = tracking.logged_steps(run.tracking_uri, run_id, "loss")
    for epoch, metrics in _history_rows(history):
        if epoch not in logged:
            tracking.log_epoch_metrics(run.tracking_uri, run_id, epoch, metrics)
    return run_id


def _whitening_images(config: PipelineConfig, data_dir: Path, count: int = 5_000) -> np.ndarray:
    """The first `count` training images (uint8, HWC), for data-dependent first-layer initialization."""
    train_splits, _ = training_splits(config, load_manifest(data_dir))
    dataset = make_eval_dataset(data_dir, splits=train_splits, batch_size=count, image_size=32)
    images, _ = next(iter(dataset))
    return images.numpy()


def _build_model(config: PipelineConfig, manifest: Manifest, plan, strategy, steps_per_epoch: int,
                 jit_compile: bool, checkpoint: Path | None, data_dir: Path) -> keras.Model:
    """The compiled model under the strategy, restored from `checkpoint` (weights + optimizer) if given."""
    train_config = config.train
    with strategy.scope():
        model = build_model(train_config.model, mean=manifest.mean, std=manifest.std,
                            fused_batchnorm=train_config.fused_batchnorm, fused_gelu=train_config.fused_gelu)
        if checkpoint is None and any(isinstance(layer, PatchWhitening) for layer in model.layers):
            # The fast net's frozen first conv whitens 2x2 patches; its filters come from the data
            # (airbench94's init_whitening_conv). A resumed run restores them from the checkpoint.
            init_whitening(model, _whitening_images(config, data_dir))
        add_weight_decay(model, train_config.weight_decay, decay_biases=train_config.decay_biases,
                         bias_multiplier=train_config.bias_learning_rate_multiplier)
        compile_model(model, config, steps_per_epoch, jit_compile)
        if plan.cluster is not None:
            _avoid_collective_shape_probe(model, strategy, train_config.batch_size // plan.num_replicas,
                                          input_size(train_config.model))
        if checkpoint is not None:
            # Optimizer slots must exist before loading, or Keras skips the saved optimizer state.
            model.optimizer.build(model.trainable_variables)
            model.load_weights(checkpoint)
    return model


def _make_datasets(config: PipelineConfig, manifest: Manifest, data_dir: Path, plan, steps_per_epoch: int,
                   initial_epoch: int):
    train_config = config.train
    train_splits, validation_splits = training_splits(config, manifest)
    image_size = input_size(train_config.model)
    # Multi-worker element sharding needs the same element order on every worker.
    deterministic = train_config.deterministic or plan.num_workers > 1
    train_dataset = make_train_dataset(
        data_dir, splits=train_splits, batch_size=train_config.batch_size, image_size=image_size, seed=config.seed,
        augment=train_config.augment, cache=train_config.cache, shuffle_buffer=train_config.shuffle_buffer,
        deterministic=deterministic, start_step=initial_epoch * steps_per_epoch,
        crop_padding=train_config.crop_padding, padding_mode=train_config.padding_mode, flip=train_config.flip,
        steps_per_epoch=steps_per_epoch,
    )
    validation_dataset = None
    if validation_splits:
        validation_dataset = make_eval_dataset(
            data_dir, splits=validation_splits, batch_size=train_config.batch_size, image_size=image_size,
            cache=train_config.cache,
        )
    return train_dataset, validation_dataset


def train(
    config: PipelineConfig,
    data_dir: str | Path,
    workdir: str | Path,
    *,
    epoch_callback: Callable[[dict], None] | None = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
) -> TrainResult:
    """Trains (or resumes, or returns the finished) run of `config` on the prepared data.

    `epoch_callback(progress)` gets `{"epoch", "epochs", **metrics}` after every epoch (how the
    Prefect task reports progress without this package importing Prefect); `callbacks` are extra
    Keras callbacks, run after the checkpoint of each epoch is written.
    """
    train_config = config.train
    # Devices and the batch split are checked first: a bad request fails before any work.
    plan = distribute.plan_devices(train_config)
    workdir = resolve_workdir(workdir)
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    run = _Run(workdir, train_config.run_name or default_run_name(config, data_key(manifest)),
               tracking.resolve_tracking_uri(config.tracking, workdir))

    if plan.is_chief and not train_config.resume:
        _discard_run(run.directory)
    state = run.read_state() if train_config.resume else {}
    if state.get("status") == "completed" and (state.get("result") or {}).get("epochs_completed") == train_config.epochs:
        logger.info("run %s is complete: reusing it", run.name)
        return TrainResult.model_validate(state["result"])

    num_train_examples = split_size(manifest, training_splits(config, manifest)[0])
    steps_per_epoch = compute_steps_per_epoch(config, num_train_examples)
    performance = configure_performance(train_config, len(plan.gpu_ids)) if configure_performance else {}
    keras.utils.set_random_seed(config.seed)
    if train_config.deterministic:
        tf.config.experimental.enable_op_determinism()
    strategy = distribute.create_strategy(plan)

    index = load_index(run.checkpoint_dir) if train_config.resume else CheckpointIndex()
    initial_epoch = index.latest.epoch if index.latest else 0
    history = run.read_history(initial_epoch) if train_config.resume else {}
    train_dataset, validation_dataset = _make_datasets(config, manifest, data_dir, plan, steps_per_epoch,
                                                       initial_epoch)
    checkpoint = run.checkpoint_dir / index.latest.model_path if initial_epoch else None
    model = _build_model(config, manifest, plan, strategy, steps_per_epoch,
                         performance.get("jit_compile") == "true", checkpoint, data_dir)
    if initial_epoch:
        logger.info("resuming %s after epoch %d", run.name, initial_epoch)

    run_id = None
    if plan.is_chief:
        run.directory.mkdir(parents=True, exist_ok=True)
        tags = {"model": train_config.model, "run_name": run.name, "devices": plan.summary(),
                "git_commit": tracking.git_commit() or "unknown",
                **{f"performance.{key}": value for key, value in performance.items()}}
        extra_params = {"derived.steps_per_epoch": steps_per_epoch, "derived.train_examples": num_train_examples,
                        "derived.peak_learning_rate": schedules.scaled_learning_rate(
                            train_config.learning_rate, train_config.batch_size),
                        "derived.data_key": data_key(manifest)}
        run_id = _open_tracking(config, run, workdir, data_dir, manifest, history, extra_params, tags)

    writable_checkpoint_dir = distribute.writable_dir(plan, run.checkpoint_dir)
    checkpoint_callback = EpochCheckpoint(
        writable_checkpoint_dir, keep=train_config.keep_checkpoints, index=index, history=history,
        history_path=run.history_path if plan.is_chief else None, write_records=plan.is_chief,
    )
    all_callbacks: list[keras.callbacks.Callback] = [EpochStatistics(train_config.batch_size), DivergenceGuard()]
    if train_config.ema_decay is not None:
        all_callbacks.append(keras.callbacks.SwapEMAWeights())  # Validate with the EMA weights.
    if train_config.lookahead_steps is not None:
        all_callbacks.append(Lookahead(train_config.lookahead_steps, steps_per_epoch,
                                       steps_per_epoch * train_config.epochs))
    all_callbacks.append(checkpoint_callback)
    if run_id is not None:
        all_callbacks.append(MetricsLogger(
            lambda epoch, metrics: tracking.log_epoch_metrics(run.tracking_uri, run_id, epoch, metrics)))
    if epoch_callback is not None:
        all_callbacks.append(EpochProgress(epoch_callback, train_config.epochs))
    all_callbacks.extend(callbacks)

    try:
        if initial_epoch < train_config.epochs:
            _fit(model, config, run_id, run.tracking_uri, train_dataset, validation_dataset, steps_per_epoch,
                 initial_epoch, all_callbacks)
    except TrainingDivergedError as error:
        if run_id is not None:
            import mlflow

            mlflow.MlflowClient(tracking_uri=run.tracking_uri).set_tag(run_id, "failure", str(error)[:5000])
            tracking.end_run(run.tracking_uri, run_id, "FAILED")
            run.write_state(run_id, "diverged")
        raise
    finally:
        distribute.cleanup_dir(plan, writable_checkpoint_dir)

    result = run.result(config, run_id, checkpoint_callback.index, checkpoint_callback.history)
    if plan.is_chief:
        _finish(run, run_id, checkpoint_callback.history, result)
    return result


def _finish(run: _Run, run_id: str, history: dict[str, list], result: TrainResult) -> None:
    """Training curves into the run dir and MLflow, then the run is marked complete."""
    import mlflow

    plot_path = plot_training_curves(history, run.directory / PLOT_NAME)
    with tracking.use_run(run.tracking_uri, run_id):
        mlflow.log_artifact(str(plot_path))
        mlflow.log_artifact(str(run.history_path))
    run.write_state(run_id, "completed", result)


def _fit(model, config, run_id, tracking_uri, train_dataset, validation_dataset, steps_per_epoch,
         initial_epoch, callbacks) -> None:
    """model.fit inside the MLflow run (for system metrics) on the chief; plain fit elsewhere."""
    fit = lambda: model.fit(  # noqa: E731
        train_dataset, epochs=config.train.epochs, initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
        validation_data=validation_dataset, callbacks=callbacks, verbose=_console_verbosity(), shuffle=False,
    )
    if run_id is None:
        fit()
        return
    import mlflow

    # Ended FINISHED on success; FAILED on any exception (a SIGKILL leaves it RUNNING until resumed).
    with tracking.tracking_uri_scope(tracking_uri):
        with mlflow.start_run(run_id=run_id, log_system_metrics=config.tracking.system_metrics):
            fit()
