"""Speed settings resolved from the config and the machine: precision policy, XLA, threads.

`configure_performance` is called once before any model is built (the Keras dtype policy is read when
layers are created) and returns what it chose, as strings, for MLflow. Why each default, next to it
below; the measurements: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from cifar import locks
from cifar.config import TrainConfig
from cifar.io import atomic_write_json, cache_directory, read_json

logger = logging.getLogger(__name__)

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with native bfloat16 math.
BF16_GPU_COMPUTE_CAPABILITY = (8, 0)  # Ampere and newer have bfloat16 tensor cores.


def cpu_bf16_flags(cpuinfo_path: str | Path = "/proc/cpuinfo") -> tuple[str, ...]:
    """The CPU's native bfloat16 instruction sets ("amx_bf16", "avx512_bf16"), sorted; () if none or unknown."""
    try:
        text = Path(cpuinfo_path).read_text()
    except OSError:
        return ()  # Not Linux: no cheap way to tell, so assume the safe answer.
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return tuple(sorted(flags.intersection(BF16_CPU_FLAGS)))
    return ()


def cpu_supports_bf16(cpuinfo_path: str | Path = "/proc/cpuinfo") -> bool:
    """Whether the CPU has native bfloat16 instructions (AVX512-BF16 or AMX-BF16).

    Both make mixed_bfloat16 the faster policy: AMX tiles by far (the fast net 3.1x stock float32 on
    a Xeon), AVX512-BF16 dot products less so (1.5x on an AMD EPYC; see docs/BENCHMARKS.md).
    """
    return bool(cpu_bf16_flags(cpuinfo_path))


def gpu_compute_capabilities(num_gpus: int) -> list[tuple[int, int]]:
    """Compute capabilities of the first `num_gpus` visible GPUs (fewer if fewer are visible)."""
    devices = tf.config.list_physical_devices("GPU")[:num_gpus]
    capabilities = [tf.config.experimental.get_device_details(device).get("compute_capability") for device in devices]
    return [tuple(capability) for capability in capabilities if capability is not None]


@dataclasses.dataclass(frozen=True)
class PrecisionChoice:
    """The Keras dtype policy a run uses, how it was chosen, and the measured speeds behind a measured choice."""

    precision: str
    reason: str  # "configured", "gpu", "no bf16 instructions", "measured", "remembered", "multi-worker"
    images_per_second: dict[str, float] = dataclasses.field(default_factory=dict)

    def settings(self) -> dict[str, str]:
        """As strings for the run's tags and params: `precision_reason`, `precision_float32_images_per_second`, ..."""
        settings = {"precision": self.precision, "precision_reason": self.reason}
        for precision, speed in sorted(self.images_per_second.items()):
            settings[f"precision_{precision}_images_per_second"] = f"{speed:.1f}"
        return settings


def resolve_precision(
    train: TrainConfig, num_gpus: int, *, num_workers: int = 1, measure: Callable[..., dict[str, float]] | None = None
) -> PrecisionChoice:
    """The Keras dtype policy: the configured one, or for "auto" the fastest safe one on this machine.

    "auto": on GPUs mixed_bfloat16 when every GPU used has compute capability >= 8.0 (no loss
    scaling needed), else mixed_float16. On a CPU without bfloat16 instructions float32 (emulated
    bfloat16 is slower). On a CPU with them it depends on the CPU: bfloat16 was 1.5x float32 on an
    AMD EPYC and 3x with AMX, yet 0.64-0.75x on a Xeon with AVX512-BF16 but no AMX exposed
    (docs/BENCHMARKS.md; with AMX and the fused batch norm ResNet-20 trained 2.7-3.6x faster than stock
    float32 Keras), so a few timed steps of the run's own model decide, remembered per CPU,
    model and library versions (`measure` replaces the timing in tests). A multi-worker run does not
    measure: every worker must pick the same policy, and noise could split them.
    """
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    if train.precision != "auto":
        if train.precision == "mixed_bfloat16" and num_gpus == 0 and not cpu_supports_bf16():
            logger.warning("mixed_bfloat16 requested on a CPU without bfloat16 instructions: expect it to be slow")
        return PrecisionChoice(train.precision, "configured")
    if num_gpus > 0:
        capabilities = gpu_compute_capabilities(num_gpus)
        if capabilities and all(capability >= BF16_GPU_COMPUTE_CAPABILITY for capability in capabilities):
            return PrecisionChoice("mixed_bfloat16", "gpu")
        return PrecisionChoice("mixed_float16", "gpu")
    if not cpu_supports_bf16():
        return PrecisionChoice("float32", "no bf16 instructions")
    if num_workers > 1:
        return PrecisionChoice("mixed_bfloat16", "multi-worker")
    return measured_cpu_precision(train, measure or measure_images_per_second)


def resolve_jit_compile(train: TrainConfig, num_gpus: int) -> bool:
    """XLA compilation for `model.compile(jit_compile=...)`: "auto" means on GPUs only."""
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    if train.jit_compile == "auto":
        # XLA's CPU backend does not call oneDNN for convolutions: 2-4x slower steps on this CPU (a
        # bfloat16 ResNet-20 step ~5x slower); only the fast net's GELU is compiled (cifar.layers.Gelu).
        return num_gpus > 0
    return train.jit_compile == "on"


def onednn_enabled() -> bool:
    """Whether TensorFlow's oneDNN kernels are on (TF_ENABLE_ONEDNN_OPTS unset or not "0"/"false")."""
    return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip().lower() not in ("0", "false")


def configure_performance(
    train: TrainConfig,
    num_gpus: int,
    *,
    num_workers: int = 1,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
    saved_kernels: dict[str, bool] | None = None,
) -> dict[str, str]:
    """Applies precision policy, threading, jit choice; returns the resolved settings for logging.

    The kernels (batch norm, GELU) are chosen too (`resolve_kernels`; `saved_kernels`: a resumed checkpoint's);
    the returned `fused_batchnorm` and `fused_gelu` ("true"/"false") are what the model must be built with.

    Thread pools keep TensorFlow's defaults (one thread per core) unless given; they can only be
    set before TensorFlow runs its first op, so a late request is logged and ignored. oneDNN is
    left on: TF reads TF_ENABLE_ONEDNN_OPTS at import, so it can only be reported here.
    Under mixed_float16 `keras.Model.compile` wraps the optimizer in a LossScaleOptimizer itself.
    """
    # Threads first: a bad count fails before any timing, and the timings run on the pools training will use.
    for setter, threads, what in (
        (tf.config.threading.set_intra_op_parallelism_threads, intra_op_threads, "intra-op"),
        (tf.config.threading.set_inter_op_parallelism_threads, inter_op_threads, "inter-op"),
    ):
        if threads is None:
            continue
        if threads < 0:
            raise ValueError(f"{what} threads must be >= 0 (0 = TensorFlow's default), got {threads}")
        try:
            setter(threads)
        except RuntimeError:
            logger.warning(
                "cannot set %s threads to %d after TensorFlow started; keeping the current pool", what, threads
            )

    choice = resolve_precision(train, num_gpus, num_workers=num_workers)
    kernels = resolve_kernels(train, choice.precision, num_gpus, num_workers=num_workers, saved=saved_kernels)
    jit_compile = resolve_jit_compile(train, num_gpus)
    keras.mixed_precision.set_global_policy(choice.precision)

    onednn = onednn_enabled()
    if not onednn:
        logger.warning("TF_ENABLE_ONEDNN_OPTS=0 turns off oneDNN: CPU convolutions and bfloat16 will be slow")
    return {
        "device": f"gpu x{num_gpus}" if num_gpus else "cpu",
        **choice.settings(),
        "jit_compile": str(jit_compile).lower(),
        **kernels.settings(),
        "cpu_bf16": ",".join(cpu_bf16_flags()) or "none",
        "onednn": "on" if onednn else "off",
        # 0 is TensorFlow's default pool.
        "intra_op_threads": str(tf.config.threading.get_intra_op_parallelism_threads() or "default"),
        "inter_op_threads": str(tf.config.threading.get_inter_op_parallelism_threads() or "default"),
    }


# bfloat16 must beat float32 by this much to be chosen: float32 is exact, and a smaller gain is within
# the noise of a few timed steps on a shared machine.
BF16_MIN_SPEEDUP = 1.05
MEASURED_PRECISIONS = ("float32", "mixed_bfloat16")
MEASURE_BATCH_SIZE = 128  # Images per timed step (the run's batch when smaller).
MEASURE_WARMUP_STEPS = 3  # Tracing and oneDNN primitive creation happen here, untimed.
# Each variant is timed in turns (A B C, A B C, ...) and keeps its best turn: a burst of other work on a shared
# machine slows one turn, not one variant, and the order variants are built in favours none.
MEASURE_ROUNDS = 3
MEASURE_MIN_STEPS = 2  # Per turn.
MEASURE_MIN_SECONDS = 0.5  # Per turn.


def precision_cache_path() -> Path:
    """The file that remembers measured choices, in this machine's cache directory (cifar.io)."""
    return cache_directory() / "precision.json"


def cpu_model_name(cpuinfo_path: str | Path = "/proc/cpuinfo") -> str:
    try:
        for line in Path(cpuinfo_path).read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


def precision_cache_key(train: TrainConfig) -> str:
    """What the measured speeds depend on: the CPU, the libraries, and the model as this run builds it."""
    parts = [
        cpu_model_name(),
        ",".join(cpu_bf16_flags()) or "no-bf16",
        f"tf {tf.__version__}",
        f"keras {keras.__version__}",
        f"onednn {'on' if onednn_enabled() else 'off'}",
        train.model,
        f"batch {min(train.batch_size, MEASURE_BATCH_SIZE)}",
        f"fused_batchnorm {train.fused_batchnorm}",
        f"fused_gelu {train.fused_gelu}",
    ]
    return " | ".join(parts)


def measured_cpu_precision(train: TrainConfig, measure: Callable[..., dict[str, float]]) -> PrecisionChoice:
    """float32 or mixed_bfloat16, whichever trains this model faster here: remembered, else measured now."""
    speeds, reason = _remembered_or_measured(
        precision_cache_key(train),
        f"{train.model} in float32 and mixed_bfloat16",
        lambda: measure(train),
        MEASURED_PRECISIONS,
    )
    faster = speeds["mixed_bfloat16"] >= BF16_MIN_SPEEDUP * speeds["float32"]
    choice = PrecisionChoice("mixed_bfloat16" if faster else "float32", reason, dict(speeds))
    logger.info(
        "Precision %s (%s: float32 %.0f, mixed_bfloat16 %.0f images/s for %s on %s)",
        choice.precision,
        reason,
        speeds["float32"],
        speeds["mixed_bfloat16"],
        train.model,
        cpu_model_name(),
    )
    return choice


def _remembered_or_measured(
    key: str, what: str, measure: Callable[[], dict[str, float]], variants: Sequence[str]
) -> tuple[dict, str]:
    """(images/s by variant, "remembered" or "measured"): from this machine's cache when it holds a speed for each
    of `variants`, else timed now and kept."""
    path = precision_cache_path()
    with locks.exclusive(path.with_name(path.name + ".lock"), "the precision measurements"):
        cache = _read_cache(path)
        entry = cache.get(key)
        speeds = entry.get("images_per_second") if isinstance(entry, dict) else None
        if isinstance(speeds, dict) and all(_positive(speeds.get(variant)) for variant in variants):
            return speeds, "remembered"
        logger.info("Timing a few training steps of %s on this CPU", what)
        speeds = measure()
        cache[key] = {"images_per_second": speeds, "measured_at": f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}"}
        atomic_write_json(path, cache)
    return speeds, "measured"


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _read_cache(path: Path) -> dict:
    try:
        cache = read_json(path)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:  # A damaged cache is measured again, not trusted.
        logger.warning("Ignoring the unreadable precision cache %s: %s", path, error)
        return {}
    return cache if isinstance(cache, dict) else {}


# Keras's own layer must beat the fused kernel by this much to be chosen: the fused kernels were 1.1-2x faster
# wherever they were measured, the one loss seen was 0.95x (the fast net in float32 on a Zen 3, issue 49), and a
# smaller difference is within the noise of a few timed steps.
KERAS_LAYER_MIN_SPEEDUP = 1.05
# The variants timed against "fused" (both layers fused where "auto"): one layer back to Keras's, the other as is.
KERAS_VARIANTS = {"batchnorm": "keras_batchnorm", "gelu": "keras_gelu"}


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Batch norm and GELU as fused kernels or as Keras's layers, how that was chosen, and the timings behind it."""

    fused_batchnorm: bool
    fused_gelu: bool
    reason: str  # "configured", "not in <model>", "gpu", "multi-worker", "checkpoint", "measured", "remembered"
    images_per_second: dict[str, float] = dataclasses.field(default_factory=dict)

    def settings(self) -> dict[str, str]:
        """As strings for the run's tags: `fused_batchnorm`, `kernels_reason`, `kernels_fused_images_per_second`..."""
        settings = {
            "fused_batchnorm": str(self.fused_batchnorm).lower(),
            "fused_gelu": str(self.fused_gelu).lower(),
            "kernels_reason": self.reason,
        }
        for variant, speed in sorted(self.images_per_second.items()):
            settings[f"kernels_{variant}_images_per_second"] = f"{speed:.1f}"
        if self.images_per_second:  # The chosen variant's timing, for the training estimate.
            settings["kernels_images_per_second"] = f"{self.images_per_second[self.variant]:.1f}"
        return settings

    @property
    def variant(self) -> str:
        """Which of the timed variants this is: "fused", "keras_batchnorm" or "keras_gelu" (both of Keras's layers
        together were not timed: the batch norm's variant stands for them)."""
        if not self.fused_batchnorm and "keras_batchnorm" in self.images_per_second:
            return "keras_batchnorm"
        if not self.fused_gelu and "keras_gelu" in self.images_per_second:
            return "keras_gelu"
        return "fused"


def kernel_flags(train: TrainConfig) -> tuple[bool, bool]:
    """(fused_batchnorm, fused_gelu) as configured, the fused kernels where "auto" (what precision is timed with)."""
    return train.fused_batchnorm is not False, train.fused_gelu is not False


def resolve_kernels(
    train: TrainConfig,
    precision: str,
    num_gpus: int,
    *,
    num_workers: int = 1,
    saved: dict[str, bool] | None = None,
    measure: Callable[..., dict[str, float]] | None = None,
) -> KernelChoice:
    """Fused kernels or Keras's layers for batch norm and GELU: as configured, else ("auto") the faster here.

    Same numerics either way (tests/test_layers.py), so only speed decides: the fused kernels were faster
    wherever measured but one (docs/BENCHMARKS.md), so on a CPU a few timed steps of the run's own model in
    its precision decide, remembered like the precision choice (`measure` replaces the timing in tests). GPUs
    use the fused kernels (cuDNN's batch norm, XLA's GELU), as does a multi-worker job (every worker must
    build the same model, and noise could split them). A resumed run keeps what its checkpoint was built
    with (`saved`, cifar.checkpoints.saved_kernels): Keras finds saved weights by layer class.
    """
    from cifar.models import fused_layers

    fused_batchnorm, fused_gelu = kernel_flags(train)
    used = fused_layers(train.model)
    auto = [layer for layer in ("batchnorm", "gelu") if layer in used and getattr(train, f"fused_{layer}") == "auto"]
    if not auto:
        return KernelChoice(fused_batchnorm, fused_gelu, "configured" if used else f"not in {train.model}")
    if saved:  # Only the "auto" layers follow the checkpoint; configured ones are what its key was made with.

        def kept(layer: str, configured: bool) -> bool:
            return saved.get(layer, configured) if layer in auto else configured

        return KernelChoice(kept("batchnorm", fused_batchnorm), kept("gelu", fused_gelu), "checkpoint")
    if num_gpus > 0:
        return KernelChoice(fused_batchnorm, fused_gelu, "gpu")
    if num_workers > 1:
        return KernelChoice(fused_batchnorm, fused_gelu, "multi-worker")
    key = f"{precision_cache_key(train)} | {precision} | kernels {','.join(auto)}"
    speeds, reason = _remembered_or_measured(
        key,
        f"{train.model} in {precision} with fused kernels and Keras's {' and '.join(auto)}",
        lambda: (measure or measure_kernel_variants)(train, precision, auto),
        ["fused", *(KERAS_VARIANTS[layer] for layer in auto)],
    )
    keras_faster = {layer: speeds[KERAS_VARIANTS[layer]] >= KERAS_LAYER_MIN_SPEEDUP * speeds["fused"] for layer in auto}
    choice = KernelChoice(
        fused_batchnorm and not keras_faster.get("batchnorm", False),
        fused_gelu and not keras_faster.get("gelu", False),
        reason,
        dict(speeds),
    )
    logger.info(
        "Batch norm %s, GELU %s (%s: %s images/s for %s in %s on %s)",
        "fused" if choice.fused_batchnorm else "Keras's",
        "fused" if choice.fused_gelu else "Keras's",
        reason,
        ", ".join(f"{variant} {speed:.0f}" for variant, speed in speeds.items()),
        train.model,
        precision,
        cpu_model_name(),
    )
    return choice


def measure_images_per_second(
    train: TrainConfig, precisions: tuple[str, ...] = MEASURED_PRECISIONS
) -> dict[str, float]:
    """Training images per second of the run's model in each precision (fused kernels where "auto")."""
    fused_batchnorm, fused_gelu = kernel_flags(train)
    return _time_variants(train, {precision: (precision, fused_batchnorm, fused_gelu) for precision in precisions})


def measure_kernel_variants(train: TrainConfig, precision: str, layers: list[str]) -> dict[str, float]:
    """Images per second in `precision` with the fused kernels, and with each of `layers` as Keras's instead."""
    fused_batchnorm, fused_gelu = kernel_flags(train)
    variants = {"fused": (precision, fused_batchnorm, fused_gelu)}
    if "batchnorm" in layers:
        variants["keras_batchnorm"] = (precision, False, fused_gelu)
    if "gelu" in layers:
        variants["keras_gelu"] = (precision, fused_batchnorm, False)
    return _time_variants(train, variants)


def _time_variants(train: TrainConfig, variants: dict[str, tuple[str, bool, bool]]) -> dict[str, float]:
    """Images per second of each (precision, fused_batchnorm, fused_gelu) variant of the run's model: a compiled SGD
    step on one fixed batch, the best of MEASURE_ROUNDS turns. Leaves the float32 policy and a cleared Keras
    session behind."""
    from cifar.models import build_model, input_size  # The model zoo is only needed when measuring.

    batch_size, size = min(train.batch_size, MEASURE_BATCH_SIZE), input_size(train.model)
    random = np.random.default_rng(0)
    images = tf.constant(random.integers(0, 256, (batch_size, size, size, 3), dtype=np.uint8))
    labels = tf.constant(random.integers(0, 10, batch_size, dtype=np.int32))
    models, speeds = {}, {name: 0.0 for name in variants}
    try:
        for name, (precision, fused_batchnorm, fused_gelu) in variants.items():
            keras.mixed_precision.set_global_policy(precision)  # Read when the layers are made.
            model = build_model(
                train.model, mean=[0.5] * 3, std=[0.25] * 3, fused_batchnorm=fused_batchnorm, fused_gelu=fused_gelu
            )
            model.compile(
                optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            for _ in range(MEASURE_WARMUP_STEPS):
                model.train_on_batch(images, labels)
            models[name] = model
        for _ in range(MEASURE_ROUNDS):
            for name, model in models.items():
                steps, start = 0, time.perf_counter()
                while steps < MEASURE_MIN_STEPS or time.perf_counter() - start < MEASURE_MIN_SECONDS:
                    model.train_on_batch(images, labels)
                    steps += 1
                speeds[name] = max(speeds[name], steps * batch_size / (time.perf_counter() - start))
    finally:
        keras.mixed_precision.set_global_policy("float32")
        keras.backend.clear_session()
    return speeds
