"""Every private TensorFlow, Keras, MLflow and Optuna API the project touches, in one place, each tied to its
pinned version.

Public APIs cover everything else. Each function below names the version it was written against
(constraints.txt pins tensorflow 2.21.0, keras 3.15.1 and mlflow 3.17.2) and why no public API does the job; when a
pin moves, this file is the one to re-check (tests/test_train.py, test_distribute.py and
test_fast_recipe.py exercise every function here).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any


def learning_rate_schedule(optimizer) -> Any:
    """The schedule (or float) an optimizer was built with. Keras 3.15: `optimizer.learning_rate`
    evaluates the schedule at the current step, so reading what was passed needs `_learning_rate`."""
    return getattr(optimizer, "_learning_rate", None)


def ema_variables(optimizer) -> tuple[list, list] | None:
    """(trainable variables, their moving averages) of an optimizer with `use_ema`, else None.
    Keras 3.15 keeps both lists private (`_trainable_variables`, `_model_variables_moving_average`)
    and only swaps them wholesale through `keras.callbacks.SwapEMAWeights`."""
    averages = getattr(optimizer, "_model_variables_moving_average", None)
    if not getattr(optimizer, "use_ema", False) or not averages:
        return None
    return optimizer._trainable_variables, averages


def variable_index(optimizer, variable) -> int:
    """The position of `variable` in an optimizer's slot lists. Keras 3.15: `_get_variable_index`
    is how its own optimizers' `update_step` finds a variable's slots; there is no public name."""
    return optimizer._get_variable_index(variable)


def build_from_sample(model, strategy, sample) -> None:
    """Makes `model.fit` build metrics and optimizer from `sample` instead of a distributed batch.

    Keras 3.15 `fit` under MultiWorkerMirroredStrategy averages the first batch across replicas
    (`strategy.reduce("MEAN", batch)`) only to learn input shapes; across workers that is a
    collective on uint8 images and fails ("Attempt to convert a value (PerReplica...)"). Shapes are
    all it needs, so `_maybe_symbolic_build` is replaced by a build from a zero batch of one
    replica's shape (`_symbolic_build`).
    """

    def symbolic_build(iterator=None, data_batch=None):
        with strategy.scope():
            model._symbolic_build(data_batch=sample)

    model._maybe_symbolic_build = symbolic_build


def patch_multi_worker_reduce() -> None:
    """Makes Keras 3.15 average scalar step results across workers.

    Its TF trainer reduces every step output under MultiWorkerMirroredStrategy with
    `strategy.reduce("MEAN", value, axis=0)`, which fails for the scalar loss and metrics
    ("Invalid reduction dimension 0 for input with 0 dimensions"). This wraps the private
    `keras.src.backend.tensorflow.trainer.reduce_per_replica` so scalars are averaged with
    `axis=None`; everything else goes to the original. Idempotent.
    """
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer as tensorflow_trainer

    original = tensorflow_trainer.reduce_per_replica
    if getattr(original, "_cifar_patched", False):
        return

    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not tensorflow_trainer._collective_all_reduce_multi_worker(strategy):
            return original(values, strategy, reduction)

        def reduce(value):
            components = getattr(value, "values", (value,))
            scalar = components[0].shape.rank == 0
            return strategy.reduce("MEAN", value, axis=None if scalar else 0)

        return tree.map_structure(reduce, values)

    reduce_per_replica._cifar_patched = True
    tensorflow_trainer.reduce_per_replica = reduce_per_replica


def patch_device_prefetch_autotune() -> None:
    """Turns tf.data's autotuner off in the per-device prefetch of distributed input (TF 2.21).

    `tf.distribute` feeds a strategy's devices through a MultiDeviceIterator: the pipeline's batches
    go into a new dataset per device (a generator plus a prefetch), made by the private
    `multi_device_iterator_ops._create_device_dataset` with default options, so the autotuner runs
    there even when the pipeline turned it off (`cifar.input_pipeline._options`). Its optimization
    thread sleeps between rounds that grow to 60 s apart, and destroying the iterator at the end of
    `model.fit` waits for it: a run sat idle for up to a minute after its last epoch (a gdb dump of
    the wait: `RootDataset::Iterator::~Iterator` joining the thread in `Model::OptimizeLoop`). The
    wrapper turns the autotuner off in each device dataset only (the pipeline's own datasets keep
    their options). No public API reaches those datasets; `tf.distribute.InputOptions` avoids the
    iterator only in per-replica mode. Idempotent.
    """
    import tensorflow as tf
    from tensorflow.python.data.ops import multi_device_iterator_ops

    original = multi_device_iterator_ops._create_device_dataset
    if getattr(original, "_cifar_patched", False):
        return

    def create_device_dataset(*args, **kwargs):
        options = tf.data.Options()
        options.autotune.enabled = False
        return original(*args, **kwargs).with_options(options)

    create_device_dataset._cifar_patched = True
    multi_device_iterator_ops._create_device_dataset = create_device_dataset


# glibc's mallopt parameters (malloc.h) and the values its own dynamic rule would reach: blocks up to 32 MiB
# (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit) come from the heap, and freed memory stays until twice that is free.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES


@functools.cache  # Once per process, as TensorFlow's own call: every later strategy finds it done.
def undo_generator_malloc_patch() -> bool:
    """Gives training back glibc's reuse of freed tensor memory, which TF 2.21 turns off process-wide.

    The first `GeneratorDataset` kernel a process makes calls `mallopt(M_MMAP_THRESHOLD, 128 KiB)` once
    (`tensorflow::data::ApplyPython311MemoryPatch`, against memory growth with Python generators,
    tensorflow#65675), which also ends glibc's dynamic threshold. Every distributed dataset makes one (the
    MultiDeviceIterator feeding the strategy's devices), so from the first epoch on every block of 128 KiB or
    more (each activation, gradient and batch) was a fresh mmap, zeroed by the kernel page by page, and unmapped
    when freed: a smoke run on the real archive made 2.35 million page faults and spent 6.3 of its ~46 CPU seconds
    in the kernel; 0.66 million, 3.0 and ~42 with this (AMD EPYC family 26; docs/BENCHMARKS.md "Freed memory
    reused"). This makes that kernel now, with an empty generator (the patch is applied then, and never again:
    a static guard), and sets what glibc's own rule would reach. Nothing here runs Python generators inside
    tf.data, which is what the patch was for. False where there is no glibc (nothing to undo).
    """
    import ctypes
    import platform

    import tensorflow as tf

    if platform.libc_ver()[0] != "glibc":
        return False
    empty = tf.data.Dataset.from_generator(lambda: iter(()), output_signature=tf.TensorSpec([], tf.int8))
    for _ in empty:  # Making its iterator makes the kernel: TensorFlow's mallopt call happens here.
        pass
    libc = ctypes.CDLL(None)
    return (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)  # fmt: skip


@contextlib.contextmanager
def mlflow_tracking_uri(tracking_uri: str) -> Iterator[None]:
    """Points MLflow's fluent API at `tracking_uri` for the block only.

    MLflow 3.17: `mlflow.set_tracking_uri` also exports `MLFLOW_TRACKING_URI`, and
    `mlflow.get_tracking_uri` falls back to that variable, so the only way to restore the URI that
    was set before (not a resolved default) is the private `_tracking_service.utils._tracking_uri`.
    The previous URI and environment are restored on exit.
    """
    import os

    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_utils

    previous_uri = tracking_utils._tracking_uri
    previous_environment = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(tracking_uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous_uri)
        if previous_environment is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous_environment


def optuna_trial(study, number: int):
    """The live `optuna.trial.Trial` numbered `number` in `study`, for a process that did not ask for it.

    Optuna 5.0: a trial asked for in one process (the search flow) and run in another (a worker)
    is reported to with `Trial.report` / `Trial.should_prune`, which need the storage's trial id;
    the public API maps numbers to ids only inside `Study.tell`. The id comes from the storage's
    `get_trial_id_from_study_id_trial_number` with the private `Study._storage` and `_study_id`.
    """
    import optuna

    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    return optuna.trial.Trial(study, trial_id)


def raw_input_signature(signature):
    """`signature` (a uint8 tensor signature) marked so the scoring server leaves the JSON input uncast.

    The mark is MLflow's own flag for signatures derived from a model's type hints
    (`is_signature_from_type_hint` in the MLmodel; a private attribute of ModelSignature in MLflow 3):
    with it the server passes `{"inputs": ...}` to predict as parsed, and PyFuncModel.predict leaves
    checking the input to the model, which `validate_images` does. The schema itself, the one MLflow
    shows and documents, is unchanged. MLflow 3.17.2; tests/test_serving.py pins this behaviour.
    """
    signature._is_signature_from_type_hint = True
    return signature


def profiled_op_times(xplane_path: str) -> list[dict]:
    """Per-op rows (`type`, `operation`, `occurrences`, `total_self_time` in µs, ...) of a TF profiler trace.
    TF 2.21 writes the trace as an XSpace protobuf; only the private `_pywrap_profiler_plugin` (what
    TensorBoard's profile plugin calls) turns it into the "framework_op_stats" table (bench/profile_step.py)."""
    import json

    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin

    data, ok = _pywrap_profiler_plugin.xspace_to_tools_data([xplane_path], "framework_op_stats", {})
    if not ok:
        raise RuntimeError(f"the profiler could not read {xplane_path}: {data[:200]!r}")
    table = json.loads(data)[0]
    columns = [column["id"] for column in table["cols"]]
    return [dict(zip(columns, (cell.get("v") if cell else None for cell in row["c"]))) for row in table["rows"]]


def saved_model_description(export_dir: str) -> str:
    """What `saved_model_cli show --dir DIR --all` prints, computed in this process.

    The CLI is a new Python with TensorFlow to import (~4 s of every export); its `show --all` is this
    one private function of `tensorflow.python.tools.saved_model_cli` (tests/test_export.py checks that
    the CLI prints the same text)."""
    import io

    from tensorflow.python.tools import saved_model_cli

    printed = io.StringIO()

    def write(*values, sep=" ", end="\n", **_):
        printed.write(sep.join(map(str, values)) + end)

    # The module's own `print`, not sys.stdout: inside a Prefect task with log_prints, builtins.print is
    # Prefect's (the text went to the run's log and the check saw nothing).
    saved_model_cli.print = write
    try:
        saved_model_cli._show_all(str(export_dir))
    finally:
        del saved_model_cli.print
    return printed.getvalue()


def preemption_handler(cluster_resolver, checkpoint_dir: str, termination_config):
    """TF's `PreemptionCheckpointHandler` watching SIGTERM on every platform (TF 2.21).

    The handler picks its behaviour from the private `failure_handling_util.detect_platform()`, which asks
    the GCE metadata server (up to 5 s) whether it runs on Google Cloud: on a GCE or GKE CPU machine it
    then watches nothing at all ("does not support usage with TPU or CPU device on GCP"), and on a GCE
    GPU machine it polls the maintenance-event metadata instead of SIGTERM. A container stop and a pod
    eviction send SIGTERM on every platform, so the platform is pinned to the non-GCE one (SIGTERM
    watched) while the handler is made. Its own checkpoint manager points at `checkpoint_dir` and never
    writes (`termination_config.save_fn` does); reading it at start finds nothing to restore.
    """
    import tensorflow as tf
    from tensorflow.python.distribute.failure_handling import failure_handling_util

    platforms = failure_handling_util.PlatformDevice
    original = failure_handling_util.detect_platform

    def detect_platform():
        return platforms.INTERNAL_GPU if tf.config.list_logical_devices("GPU") else platforms.INTERNAL_CPU

    failure_handling_util.detect_platform = detect_platform
    try:
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(), directory=str(checkpoint_dir), max_to_keep=1)
        return tf.distribute.experimental.PreemptionCheckpointHandler(
            cluster_resolver, manager, termination_config=termination_config
        )
    finally:
        failure_handling_util.detect_platform = original


def preemption_signalled(handler) -> bool:
    """Whether this process received SIGTERM while `handler` watched. TF 2.21 keeps it private
    (`_received_own_sigterm`): a signal after the last training step is never acted on by the handler."""
    return handler._received_own_sigterm.is_set()


@contextlib.contextmanager
def raw_weights_after_fit(optimizer, keep: bool) -> Iterator[None]:
    """With `keep`, `model.fit` leaves the raw weights in place instead of their moving average.

    Keras 3.15 `fit` ends with `optimizer.finalize_variable_values`, which with `use_ema` overwrites every
    trainable variable with its EMA: right at the end of training, wrong for a fit that runs only the rest
    of an interrupted epoch, before another fit continues from the raw weights. No public switch exists,
    so the instance's method is a no-op for the block.
    """
    if not keep:
        yield
        return
    optimizer.finalize_variable_values = lambda variables: None
    try:
        yield
    finally:
        del optimizer.finalize_variable_values


def save_if_preempted(handler) -> None:
    """`handler.save_checkpoint_if_preempted()` without the deprecation warning TF 2.21 logs from inside it
    (its own `_save_checkpoint` reads its deprecated `total_run_calls`); `deprecation.silence` is private."""
    from tensorflow.python.util import deprecation

    with deprecation.silence():
        handler.save_checkpoint_if_preempted()
