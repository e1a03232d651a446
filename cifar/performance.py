"""Speed settings resolved from the config and the machine: precision policy, XLA, threads.

`configure_performance` is called once before any model is built (the Keras dtype policy is read when
layers are created) and returns what it chose, as strings, for MLflow. Why each default, next to it
below; the measurements: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import keras
import tensorflow as tf

from cifar.config import TrainConfig

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


def resolve_precision(train: TrainConfig, num_gpus: int) -> str:
    """The Keras dtype policy: the configured one, or for "auto" the fastest safe one on this machine.

    "auto": on GPUs mixed_bfloat16 when every GPU used has compute capability >= 8.0 (no loss
    scaling needed), else mixed_float16; on CPU mixed_bfloat16 when the CPU has bfloat16
    instructions (emulated bfloat16 is slower than float32), else float32. On a 2-core Xeon with
    AMX-BF16, mixed_bfloat16 (oneDNN on AMX tiles) with the fused batch norm trained ResNet-20
    2.7-3.6x faster than stock float32 Keras; the fused GELU (`cifar.layers.Gelu`, one XLA kernel
    forward and one backward instead of a dozen bfloat16 passes) trained the fast net 1.7x faster.
    """
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    if train.precision != "auto":
        if train.precision == "mixed_bfloat16" and num_gpus == 0 and not cpu_supports_bf16():
            logger.warning("mixed_bfloat16 requested on a CPU without bfloat16 instructions: expect it to be slow")
        return train.precision
    if num_gpus > 0:
        capabilities = gpu_compute_capabilities(num_gpus)
        if capabilities and all(capability >= BF16_GPU_COMPUTE_CAPABILITY for capability in capabilities):
            return "mixed_bfloat16"
        return "mixed_float16"
    return "mixed_bfloat16" if cpu_supports_bf16() else "float32"


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
    train: TrainConfig, num_gpus: int, *, intra_op_threads: int | None = None, inter_op_threads: int | None = None
) -> dict[str, str]:
    """Applies precision policy, threading, jit choice; returns the resolved settings for logging.

    Thread pools keep TensorFlow's defaults (one thread per core) unless given; they can only be
    set before TensorFlow runs its first op, so a late request is logged and ignored. oneDNN is
    left on: TF reads TF_ENABLE_ONEDNN_OPTS at import, so it can only be reported here.
    Under mixed_float16 `keras.Model.compile` wraps the optimizer in a LossScaleOptimizer itself.
    """
    precision = resolve_precision(train, num_gpus)
    jit_compile = resolve_jit_compile(train, num_gpus)
    keras.mixed_precision.set_global_policy(precision)

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

    onednn = onednn_enabled()
    if not onednn:
        logger.warning("TF_ENABLE_ONEDNN_OPTS=0 turns off oneDNN: CPU convolutions and bfloat16 will be slow")
    return {
        "device": f"gpu x{num_gpus}" if num_gpus else "cpu",
        "precision": precision,
        "jit_compile": str(jit_compile).lower(),
        "fused_batchnorm": str(train.fused_batchnorm).lower(),
        "fused_gelu": str(train.fused_gelu).lower(),
        "cpu_bf16": ",".join(cpu_bf16_flags()) or "none",
        "onednn": "on" if onednn else "off",
        # 0 is TensorFlow's default pool.
        "intra_op_threads": str(tf.config.threading.get_intra_op_parallelism_threads() or "default"),
        "inter_op_threads": str(tf.config.threading.get_inter_op_parallelism_threads() or "default"),
    }
