"""The training stage: `train(config, data_dir, workdir)` fits a model and checkpoints every epoch.

The recipe is the cifar10_estimator's, modernised (SGD with momentum, a schedule from `cifar.schedules`,
label smoothing, weight EMA), plus airbench's parameter groups, Lookahead and Muon for the fast presets.
Run directory contract: `cifar.checkpoints`; why each choice: next to the code below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from cifar import cluster, compat, distribute, locks, schedules, tracking
from cifar.callbacks import (
    DivergenceGuard,
    EpochCheckpoint,
    EpochProgress,
    EpochStatistics,
    Lookahead,
    MetricsLogger,
    PreciseBatchNorm,
    SaveOnSigterm,
    TrainingDivergedError,
)
from cifar.checkpoints import CheckpointIndex, RunDirectory, TrainingStart, history_rows, load_index, saved_kernels
from cifar.config import PipelineConfig, resolve_workdir
from cifar.data.manifest import Manifest, load_manifest
from cifar.estimate import SpeedMemory, TrainingEstimate, announce_estimate
from cifar.input_pipeline import make_eval_dataset, make_train_dataset, split_size
from cifar.layers import PatchWhitening
from cifar.losses import SparseCrossentropyWithSmoothing
from cifar.models import build_model, init_whitening, input_size
from cifar.optimizers import ConvMuon, GroupedSGD, is_conv_filter
from cifar.performance import configure_performance
from cifar.plots import plot_training_curves
from cifar.preemption import TrainingPreempted
from cifar.results import TrainResult
from cifar.reuse import training_key
from cifar.workdir import run_dir

__all__ = ["TrainResult", "TrainingDivergedError", "TrainingPreempted", "default_run_name", "train"]

logger = logging.getLogger(__name__)


def default_run_name(model: str, key: str) -> str:
    """`<model>-<first 12 characters of the training key>`.

    The key covers the data, the training fields, the seed and the training code (`cifar.reuse.training_key`),
    so a changed setting or a changed module trains a new run in a new folder, with a new MLflow run.
    """
    return f"{model}-{key[:12]}"


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
        raise ValueError(f"batch_size {config.train.batch_size} is larger than the {num_examples} training examples")
    cap = config.train.steps_per_epoch
    return min(full_batches, cap) if cap else full_batches


BATCH_NORM_BIAS_PATTERN = r"(^|/)beta$"  # Batch-norm biases (Keras's and ours are named "beta").
WHITENING_BIAS_PATTERN = r"(^|/)whitening/bias$"  # The fast net's PatchWhitening bias.


def add_weight_decay(
    model: keras.Model,
    weight_decay: float,
    *,
    decay_biases: bool = False,
    bias_multiplier: float = 1.0,
    whitening_bias_multiplier: float = 1.0,
    decay_filters: bool = True,
) -> list[str]:
    """Puts an L2 penalty (gradient `weight_decay * w`) on every conv/dense kernel; returns their paths.

    The penalty `weight_decay / 2 * sum(w**2)` is exactly the estimator's `weight_decay * tf.nn.l2_loss(w)`
    and PyTorch's SGD `weight_decay`. It is a loss penalty rather than the optimizer's decoupled
    `weight_decay` because decoupled decay bypasses momentum (its strength differs by ~1/(1 - momentum)),
    so the estimator's and the ResNet-9 recipes' published coefficients would not carry over.

    With `decay_biases` every other trainable variable (biases, batch-norm beta/gamma) is decayed
    too, by `weight_decay / multiplier` where its learning rate is `multiplier` times the base
    (`bias_multiplier` for batch-norm biases, `whitening_bias_multiplier` for the fast net's
    whitening bias): the product of rate and decay, i.e. how much of the weight each step removes,
    is then the same for every parameter (airbench's parameterisation). `decay_filters=False` leaves the convolution
    filters alone: Muon renormalises them every step, and a penalty's gradient would only bend the
    direction it orthogonalises.
    """
    if weight_decay <= 0:
        return []
    regularizer = keras.regularizers.L2(weight_decay / 2.0)
    bias_regularizer = keras.regularizers.L2(weight_decay / 2.0 / bias_multiplier)
    whitening_bias_regularizer = keras.regularizers.L2(weight_decay / 2.0 / whitening_bias_multiplier)
    decayed = []
    for variable in model.trainable_variables:
        if not decay_filters and is_conv_filter(variable):
            continue
        # Kernels of Conv/Dense/Depthwise/Separable layers; biases and BN gamma/beta only on request.
        if variable.name.endswith("kernel"):
            variable.regularizer = regularizer
        elif decay_biases:
            if re.search(BATCH_NORM_BIAS_PATTERN, variable.path):
                variable.regularizer = bias_regularizer
            elif re.search(WHITENING_BIAS_PATTERN, variable.path):
                variable.regularizer = whitening_bias_regularizer
            else:
                variable.regularizer = regularizer
        else:
            continue
        decayed.append(variable.path)
    return decayed


def make_optimizer(config: PipelineConfig, steps_per_epoch: int) -> GroupedSGD:
    """SGD with momentum on the configured schedule, with airbench's parameter groups when asked;
    with `optimizer: muon`, Muon on the conv filters, its rate following the same schedule's shape.

    The learning rate is given for batch 128 and scaled linearly with the global batch size
    (`schedules.scaled_learning_rate`). With the groups (the fast recipes), batch-norm biases get their
    own rate and the whitening bias stops after `whitening_bias_epochs`; `Lookahead` (cifar.callbacks)
    replaces EMA there. Muon's filters carry no L2 penalty: Muon renormalises them every step.
    """
    train = config.train
    schedule = schedules.make_schedule(train, steps_per_epoch)
    multipliers = {}
    if train.bias_learning_rate_multiplier != 1.0:
        multipliers[BATCH_NORM_BIAS_PATTERN] = train.bias_learning_rate_multiplier
    if train.whitening_bias_learning_rate_multiplier != 1.0:
        multipliers[WHITENING_BIAS_PATTERN] = train.whitening_bias_learning_rate_multiplier
    stops = {}
    if train.whitening_bias_epochs is not None:
        stops[WHITENING_BIAS_PATTERN] = int(round(train.whitening_bias_epochs * steps_per_epoch))
    settings = {
        "learning_rate": schedule,
        "momentum": train.momentum,
        "nesterov": train.nesterov,
        "learning_rate_multipliers": multipliers,
        "stop_after_steps": stops,
        "use_ema": train.ema_decay is not None,
        "ema_momentum": train.ema_decay or 0.99,
    }
    if train.optimizer == "muon":
        # The filters' rate is the schedule's times this ratio: muon_learning_rate at the schedule's peak.
        peak = schedules.scaled_learning_rate(train.learning_rate, train.batch_size)
        return ConvMuon(
            muon_learning_rate_multiplier=train.muon_learning_rate / peak, muon_momentum=train.muon_momentum, **settings
        )
    return GroupedSGD(**settings)


def compile_model(model: keras.Model, config: PipelineConfig, steps_per_epoch: int, jit_compile: bool) -> None:
    train = config.train
    if train.label_smoothing > 0:
        loss = SparseCrossentropyWithSmoothing(train.label_smoothing)
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=make_optimizer(config, steps_per_epoch),
        loss=loss,
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        jit_compile=jit_compile,
    )


@dataclasses.dataclass(frozen=True)
class TrainingJob:
    """What one training run is about: its config and devices, its data, its folder and its key."""

    config: PipelineConfig
    plan: distribute.DevicePlan
    workdir: Path
    data_dir: Path
    manifest: Manifest
    run: RunDirectory
    key: str
    tracking_uri: str
    steps_per_epoch: int
    num_train_examples: int

    @property
    def train(self):
        return self.config.train


def plan_job(config: PipelineConfig, data_dir: str | Path, workdir: str | Path) -> TrainingJob:
    """Checks the request against the devices and the data, and names the run; no training work yet."""
    plan = distribute.plan_devices(config.train)  # A bad device request fails before anything else.
    workdir = resolve_workdir(workdir)
    manifest = load_manifest(data_dir)
    key = training_key(config, manifest.key or "")
    num_train_examples = split_size(manifest, training_splits(config, manifest)[0])
    return TrainingJob(
        config=config,
        plan=plan,
        workdir=workdir,
        data_dir=Path(data_dir),
        manifest=manifest,
        run=RunDirectory(run_dir(workdir, config.train.run_name or default_run_name(config.train.model, key))),
        key=key,
        tracking_uri=tracking.resolve_tracking_uri(config.tracking, workdir),
        steps_per_epoch=compute_steps_per_epoch(config, num_train_examples),
        num_train_examples=num_train_examples,
    )


def train(
    config: PipelineConfig,
    data_dir: str | Path,
    workdir: str | Path,
    *,
    refresh: bool = False,
    epoch_callback: Callable[[dict], None] | None = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    rendezvous: cluster.Rendezvous | None = None,
) -> TrainResult:
    """Trains (or resumes, or returns the finished) run of `config` on the prepared data.

    `refresh` retrains from scratch even when a finished run exists. `epoch_callback(progress)`
    gets `{"epoch", "epochs", **metrics}` after every epoch (how the Prefect task reports progress
    without this package importing Prefect); `callbacks` are extra Keras callbacks, run after the
    checkpoint of each epoch is written. `rendezvous` makes this process one of `train.workers` that train
    together (`cifar.cluster`): its index 0 is the chief, which owns the run folder and the MLflow run.
    """
    job = plan_job(config, data_dir, workdir)
    # One process trains a run folder at a time; a second run of the same key waits, then reuses the result.
    owner = locks.exclusive(locks.lock_path(job.run.path), f"the training run {job.run.name}")
    chief = job.plan.is_chief and (rendezvous is None or rendezvous.index == 0)
    with owner if chief else contextlib.nullcontext():
        return _train(job, refresh, epoch_callback, callbacks, rendezvous)


def _train(
    job: TrainingJob,
    refresh: bool,
    epoch_callback: Callable[[dict], None] | None,
    callbacks: Sequence[keras.callbacks.Callback],
    rendezvous: cluster.Rendezvous | None,
) -> TrainResult:
    """`train` once the run folder is this process's: reuse, resume or train from scratch.

    A resume restores weights, optimizer state (momentum, step counter, EMA), the epoch and the MLflow
    run. Workers of a rendezvous start where the chief's run stands (its checkpoint fetched from MLflow);
    workers of a hand-made TF_CONFIG cluster read the chief's run folder, which they must all see."""
    config, run = job.config, job.run
    local = rendezvous is None or rendezvous.index == 0  # This process reads (the chief: owns) the run folder.
    if local:
        if job.plan.is_chief and (refresh or not job.train.resume):
            run.discard()  # `--fresh` or `refresh`: a new folder and a new MLflow run.
        finished = run.completed(job.key)
        if finished is not None:
            logger.info("run %s is complete under the same key: reusing it", run.name)
            return finished
        run.check_key(job.key)  # A named run (`train.run_name`) made under another key is refused, not overwritten.
    index = load_index(run.checkpoint_dir) if local else CheckpointIndex()
    start = TrainingStart.of(run, index)
    if rendezvous is not None:
        job, start = _join(job, rendezvous, index, start)

    saved = saved_kernels(start.checkpoint) if start.checkpoint is not None else None  # A resume builds its kinds.
    performance = configure_performance(job.train, len(job.plan.gpu_ids), num_workers=job.plan.num_workers,
                                        saved_kernels=saved)  # fmt: skip
    # What is left, said before it starts (the chief's; None when nothing is left).
    estimate = announce_estimate(job.config, performance, job.steps_per_epoch, start.epoch, job.plan)
    keras.utils.set_random_seed(config.seed)
    if job.train.deterministic:
        tf.config.experimental.enable_op_determinism()
    strategy = distribute.create_strategy(job.plan)
    history = run.read_history(start.epoch) if local else {}
    model = _build_model(job, strategy, performance, start.checkpoint)
    if not local and start.checkpoint is not None:
        shutil.rmtree(start.checkpoint.parent, ignore_errors=True)  # The fetched copy, loaded.
    if start.checkpoint is not None:
        logger.info("resuming %s after %s", run.name, start.describe())

    run_id = _open_tracking(job, history, performance, estimate) if job.plan.is_chief else None
    checkpoint_dir = distribute.writable_dir(job.plan, run.checkpoint_dir)
    checkpointer = EpochCheckpoint(
        checkpoint_dir,
        keep=job.train.keep_checkpoints,
        index=index,
        history=history,
        history_path=run.history_path if job.plan.is_chief else None,
        write_records=job.plan.is_chief,
    )
    resolver = strategy.cluster_resolver if job.plan.cluster is not None else None
    stopper = SaveOnSigterm(checkpointer, job.steps_per_epoch, start.partial, resolver)
    try:
        if start.epoch < job.train.epochs:
            all_callbacks = [*_callbacks(job, checkpointer, stopper, run_id, epoch_callback), *callbacks]
            if estimate is not None:  # After EpochStatistics, which times the epoch.
                all_callbacks.append(SpeedMemory(estimate, run.name))
            with stopper.watching():
                _fit(job, model, start, all_callbacks, run_id)
    except (TrainingDivergedError, TrainingPreempted) as error:
        _record_stop(job, run_id, error)
        raise
    except distribute.LOST_PEER_ERRORS as error:  # A process of the job died or became unreachable.
        lost = distribute.lost_peer(error, job.plan)
        if lost is None:
            raise
        _record_stop(job, run_id, lost)
        raise lost from error
    finally:
        distribute.cleanup_dir(job.plan, checkpoint_dir)

    result = _result(job, run_id, checkpointer.index, checkpointer.history, estimate)
    if job.plan.is_chief:
        _finish(job, run_id, checkpointer.history, result)
    return result


def _join(
    job: TrainingJob, rendezvous: cluster.Rendezvous, index: CheckpointIndex, start: TrainingStart
) -> tuple[TrainingJob, TrainingStart]:
    """Joins the job's other processes: the chief offers where its run stands, every worker starts there."""
    chief = rendezvous.index == 0
    offer = cluster.resume_point(job.run, index, job.tracking_uri) if chief else None
    spec = rendezvous.join(cluster.data_digest(job.manifest), offer)
    job = dataclasses.replace(job, plan=distribute.plan_devices(job.train, tf_config=spec.tf_config(rendezvous.index)))
    if chief:
        return job, start
    return job, TrainingStart(spec.resume.epoch, spec.resume.partial, cluster.fetch_checkpoint(spec.resume))


def _record_stop(job: TrainingJob, run_id: str | None, error: Exception) -> None:
    """A diverged run (NaN loss: the bad epoch was not checkpointed) or one that lost a worker ends FAILED in
    MLflow; a run stopped by SIGTERM (its state saved) ends KILLED. The next run of the same key resumes it."""
    if run_id is None:
        return
    if isinstance(error, TrainingPreempted):
        tracking.end_run(job.tracking_uri, run_id, "KILLED")
        status = "preempted"
    else:
        tracking.mark_failed(job.tracking_uri, run_id, str(error))
        status = "diverged" if isinstance(error, TrainingDivergedError) else "failed"
    job.run.write_state(job.key, run_id, job.tracking_uri, status)


def _build_model(job: TrainingJob, strategy, performance: dict[str, str], checkpoint: Path | None) -> keras.Model:
    """The compiled model under the strategy, with the kernels and XLA choice `performance` resolved, restored from
    `checkpoint` (weights + optimizer) if given."""
    train = job.train
    with strategy.scope():
        model = build_model(
            train.model,
            mean=job.manifest.mean,
            std=job.manifest.std,
            fused_batchnorm=performance["fused_batchnorm"] == "true",
            fused_gelu=performance["fused_gelu"] == "true",
        )
        if checkpoint is None and any(isinstance(layer, PatchWhitening) for layer in model.layers):
            # The fast net's frozen first conv whitens 2x2 patches; its filters come from the data
            # (airbench94's init_whitening_conv). A resumed run restores them from the checkpoint.
            init_whitening(model, _whitening_images(job))
        add_weight_decay(
            model,
            train.weight_decay,
            decay_biases=train.decay_biases,
            bias_multiplier=train.bias_learning_rate_multiplier,
            whitening_bias_multiplier=train.whitening_bias_learning_rate_multiplier,
            decay_filters=train.optimizer != "muon",
        )
        compile_model(model, job.config, job.steps_per_epoch, performance.get("jit_compile") == "true")
        if job.plan.cluster is not None:
            batch = train.batch_size // job.plan.num_replicas
            size = input_size(train.model)
            compat.build_from_sample(
                model, strategy, (tf.zeros([batch, size, size, 3], tf.uint8), tf.zeros([batch], tf.int32))
            )
        if checkpoint is not None:
            # Optimizer slots must exist before loading, or Keras skips the saved optimizer state.
            model.optimizer.build(model.trainable_variables)
            model.load_weights(checkpoint)
    return model


def _whitening_images(job: TrainingJob, count: int = 5_000) -> np.ndarray:
    """The first `count` training images (uint8, HWC), for data-dependent first-layer initialization."""
    train_splits, _ = training_splits(job.config, job.manifest)
    dataset = make_eval_dataset(job.data_dir, splits=train_splits, batch_size=count, image_size=32)
    images, _ = next(iter(dataset))
    return images.numpy()


def _precise_bn_batches(job: TrainingJob) -> tf.data.Dataset:
    """The first `train.precise_bn_images` training images, as they are (no augmentation), in training batches.

    The same images on every worker of a multi-worker run, so every replica gets the same statistics.
    """
    train_splits, _ = training_splits(job.config, job.manifest)
    batch_size = min(job.train.batch_size, job.train.precise_bn_images)
    dataset = make_eval_dataset(
        job.data_dir, splits=train_splits, batch_size=batch_size, image_size=input_size(job.train.model)
    )
    return dataset.take(-(-job.train.precise_bn_images // batch_size)).cache()


def _open_tracking(
    job: TrainingJob, history: dict[str, list], performance: dict[str, str], estimate: TrainingEstimate | None
) -> str:
    """The pipeline's MLflow run id: the one in state.json if the store still has it, else a new one.

    A new run gets every config field as a param, the dataset as an input, the config and the
    manifest as artifacts. Epochs checkpointed but never reported (killed in between) are
    reported now, once each, so the metric history has one value per epoch (`history` holds
    only checkpointed epochs).
    """
    import mlflow

    run, uri, train = job.run, job.tracking_uri, job.train
    run.path.mkdir(parents=True, exist_ok=True)
    # What this attempt runs on (a resume may differ), set on every attempt.
    attempt_tags = {
        "devices": job.plan.summary(),
        **{f"performance.{key}": value for key, value in performance.items()},
        **(estimate.tags() if estimate else {}),
    }
    run_id = run.read_state().get("mlflow_run_id")
    if not (run_id and tracking.run_exists(uri, run_id)):
        # Derived values and keys are tags: as params they would crowd the compare page's chosen settings.
        derived = {
            "derived.steps_per_epoch": job.steps_per_epoch,
            "derived.train_examples": job.num_train_examples,
            "derived.peak_learning_rate": schedules.scaled_learning_rate(train.learning_rate, train.batch_size),
            "derived.data_key": job.manifest.key,
            "derived.training_key": job.key,
        }
        tags = {"model": train.model, "run_name": run.name, **tracking.source_tags()}
        tags |= tracking.stringify_params(derived)
        tags[tracking.NOTE_TAG] = f"Preset `{job.config.preset}`, training directory `{run.path}`."
        name = tracking.human_run_name(job.config)
        run_id = tracking.create_run(uri, job.workdir, job.config.tracking.experiment, name, tags)
        params = {key: value for key, value in job.config.flat().items() if key != "tracking.run_name"}
        # What the config's `auto`s resolved to on the machine that started the run (tags: each attempt's).
        params |= {f"performance.{key}": performance[key] for key in ("precision", "fused_batchnorm", "fused_gelu")}
        if estimate is not None and estimate.seconds is not None:  # The first attempt's, beside what it took.
            params["estimated_training_minutes"] = round(estimate.seconds / 60, 1)
        tracking.log_params(uri, run_id, params)
        with tracking.use_run(uri, run_id):
            tracking.log_training_input(tracking.manifest_dataset(job.manifest, job.data_dir))
            mlflow.log_dict(job.config.model_dump(mode="json"), "config.json")
            mlflow.log_artifact(str(job.data_dir / "manifest.json"))
    client = tracking.mlflow_client(uri)
    for key, value in attempt_tags.items():
        client.set_tag(run_id, key, value)
    run.write_state(job.key, run_id, uri, "running")
    # Metrics MLflow missed (a kill between the checkpoint and the report) are back-filled, one value per epoch.
    logged = tracking.logged_steps(uri, run_id, "loss")
    for epoch, metrics in history_rows(history):
        if epoch not in logged:
            tracking.log_epoch_metrics(uri, run_id, epoch, metrics)
    return run_id


def _callbacks(
    job: TrainingJob,
    checkpointer: EpochCheckpoint,
    stopper: SaveOnSigterm,
    run_id: str | None,
    epoch_callback: Callable[[dict], None] | None,
) -> list[keras.callbacks.Callback]:
    """The training callbacks, in the order `cifar.callbacks` explains."""
    train = job.train
    callbacks: list[keras.callbacks.Callback] = [EpochStatistics(train.batch_size), DivergenceGuard()]
    if train.ema_decay is not None:
        callbacks.append(keras.callbacks.SwapEMAWeights())  # Validate with the EMA weights.
    if train.precise_bn_images and training_splits(job.config, job.manifest)[1]:
        callbacks.append(PreciseBatchNorm(_precise_bn_batches(job)))  # After the EMA swap: the weights validated.
    if train.lookahead_steps is not None:
        callbacks.append(Lookahead(train.lookahead_steps, job.steps_per_epoch, job.steps_per_epoch * train.epochs))
    callbacks += [stopper, checkpointer]  # A SIGTERM's save holds the step's Lookahead update; then the epoch's.
    if run_id is not None:
        callbacks.append(
            MetricsLogger(lambda epoch, metrics: tracking.log_epoch_metrics(job.tracking_uri, run_id, epoch, metrics))
        )
    if epoch_callback is not None:
        callbacks.append(EpochProgress(epoch_callback, train.epochs))
    return callbacks


# The training fields `make_train_dataset` takes as they are.
AUGMENTATION_FIELDS = {
    "augment",
    "shuffle_buffer",
    "crop_padding",
    "padding_mode",
    "flip",
    "brightness_jitter",
    "contrast_jitter",
}


def _fit(job: TrainingJob, model: keras.Model, start: TrainingStart, callbacks: list, run_id: str | None) -> None:
    """model.fit inside the MLflow run (for system metrics) on the chief; plain fit elsewhere.

    After a stop mid-epoch, a first fit runs the rest of that epoch (its remaining steps), a second the epochs after.
    """
    train = job.train
    train_splits, validation_splits = training_splits(job.config, job.manifest)
    shared = {"batch_size": train.batch_size, "image_size": input_size(train.model), "cache": train.cache}
    augmentation = train.model_dump(include=AUGMENTATION_FIELDS)
    # Multi-worker element sharding needs the same element order on every worker.
    order = {"seed": job.config.seed, "deterministic": train.deterministic or job.plan.num_workers > 1}
    validation_dataset = None
    if validation_splits:
        validation_dataset = make_eval_dataset(job.data_dir, splits=validation_splits, **shared)
    verbose = 1 if sys.stdout.isatty() else 2  # A live progress bar on a terminal, one line per epoch in logs.
    spans = [(start.epoch, train.epochs, 0)]  # (first epoch, end epoch, steps of the first one already done)
    if start.partial is not None:
        spans = [(start.epoch, start.epoch + 1, start.partial.step), (start.epoch + 1, train.epochs, 0)]
    with tracking.active_run(job.tracking_uri, run_id, system_metrics=job.config.tracking.system_metrics):
        # Ended FINISHED on success; FAILED on any exception (a SIGKILL leaves it RUNNING until resumed).
        for first, end, done in spans:
            if first >= end:
                continue
            start_step = first * job.steps_per_epoch + done
            steps = {"start_step": start_step, "steps_per_epoch": job.steps_per_epoch}
            train_dataset = make_train_dataset(
                job.data_dir, splits=train_splits, **shared, **augmentation, **order, **steps
            )
            # A fit of the rest of an epoch keeps the raw weights for the fit after it (see compat).
            with compat.raw_weights_after_fit(model.optimizer, keep=end < train.epochs):
                model.fit(
                    train_dataset,
                    validation_data=validation_dataset,
                    callbacks=callbacks,
                    verbose=verbose,
                    shuffle=False,
                    epochs=end,
                    initial_epoch=first,
                    steps_per_epoch=job.steps_per_epoch - done,
                )
            if model.stop_training:  # A pruned trial, or a SIGTERM at an epoch's last step.
                break


def _result(
    job: TrainingJob, run_id: str | None, index: CheckpointIndex, history: dict, estimate: TrainingEstimate | None
) -> TrainResult:
    rows, best, run = history_rows(history), index.best, job.run
    seconds = [value for value in history.get("epoch_seconds", []) if value is not None]
    return TrainResult(
        key=job.key,
        run_name=run.name,
        run_dir=str(run.path),
        checkpoint_dir=str(run.checkpoint_dir),
        mlflow_run_id=run_id,
        tracking_uri=job.tracking_uri,
        epochs_completed=index.latest.epoch if index.latest else 0,
        best_epoch=index.best_epoch,
        val_accuracy=best.metrics.get("val_accuracy") if best else None,
        metrics=rows[-1][1] if rows else {},
        model=job.train.model,
        training_seconds=sum(seconds) if seconds else None,
        estimate=estimate.describe() if estimate else None,
        estimated_seconds=estimate.seconds if estimate else None,
    )


def _finish(job: TrainingJob, run_id: str, history: dict[str, list], result: TrainResult) -> None:
    """Training curves into the run dir and MLflow, then the run is marked complete.

    A run a callback stopped before `train.epochs` (a search's pruner) is marked "stopped", not
    complete: it is never reused as finished, and the next run of the same key resumes it.
    """
    import mlflow

    plot_path = plot_training_curves(history, job.run.plot_path)
    # Single values a person compares across runs (no step: the runs table and bar charts show them).
    summary = {"best_val_accuracy": result.val_accuracy, "epochs_completed": result.epochs_completed}
    summary["training_time_s"] = result.training_seconds  # Wall time of the epochs, validation included.
    with tracking.use_run(job.tracking_uri, run_id):
        mlflow.log_metrics(tracking.finite_metrics(summary))
        mlflow.log_artifact(str(plot_path))
        mlflow.log_artifact(str(job.run.history_path))
    status = "completed" if result.epochs_completed >= job.train.epochs else "stopped"
    if status == "stopped":
        logger.info("run %s stopped after epoch %d of %d", job.run.name, result.epochs_completed, job.train.epochs)
    job.run.write_state(job.key, run_id, job.tracking_uri, status, result)
