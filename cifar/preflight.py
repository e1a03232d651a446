"""Checks a request against this machine before any work: devices, batch size and memory.

A deployment form lets anyone ask for 4 GPUs on a CPU worker or a batch of 40,000; such a run must
fail at once with the reason, not after the data stage or by being killed for memory. The memory
figure is an estimate (activations kept for the backward pass, from each model's feature-map sizes,
plus the in-memory dataset cache and the runtime), deliberately on the generous side.
"""

from __future__ import annotations

import os

from cifar.config import TRAIN_EXAMPLES, PipelineConfig, TrainConfig
from cifar.names import parse_model_name
from cifar.quiet import import_tensorflow

GIB = 1 << 30
RUNTIME_BYTES = 1 * GIB  # TensorFlow, Keras, Prefect and MLflow in one process.
STORED_TENSORS = 4  # Tensors kept per layer output for the backward pass (conv, norm, activation, gradient).
# Feature-map floats per image, per model family; a ResNet adds 2 convs per block at 32x32x16,
# 16x16x32 and 8x8x64 (28,672 floats per block and stage triple) after its 32x32x16 stem.
FEATURE_FLOATS = {"tiny": 32 * 32 * 8, "tutorial": 80_000, "fast": 350_000}
RESNET_STEM_FLOATS, RESNET_BLOCK_FLOATS = 32 * 32 * 16, 2 * (32 * 32 * 16 + 16 * 16 * 32 + 8 * 8 * 64)


class ImpossibleRequestError(ValueError):
    """The request cannot run on this machine; the message names the field and the reason."""


def bytes_per_image(model: str) -> int:
    """Training memory per image of the batch: its activations, kept for the backward pass (float32)."""
    family, depth = parse_model_name(model)
    floats = (
        RESNET_STEM_FLOATS + RESNET_BLOCK_FLOATS * (depth - 2) // 6 if family == "resnet" else FEATURE_FLOATS[family]
    )
    return 4 * STORED_TENSORS * floats


def training_bytes(config: PipelineConfig) -> int:
    """Estimated peak memory of training `config`: runtime, cached dataset and one batch's activations."""
    train = config.train
    cache = TRAIN_EXAMPLES * 3 * 32 * 32 if train.cache else 0
    return RUNTIME_BYTES + cache + train.batch_size * bytes_per_image(train.model)


def available_bytes() -> int:
    """Memory this process can still use (what the kernel reports as available)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_request(config: PipelineConfig, *, available: int | None = None) -> None:
    """Raises ImpossibleRequestError when the devices, the batch or the memory cannot serve `config`."""
    train = config.train
    _check_devices(train)
    data = config.data
    examples = TRAIN_EXAMPLES - (0 if train.use_all_training_data else data.validation_size)
    if data.expect_official_counts and train.batch_size > examples:
        raise ImpossibleRequestError(
            f"train.batch_size {train.batch_size} is larger than the {examples:,} "
            "training examples: lower train.batch_size"
        )
    needed, available = training_bytes(config), available_bytes() if available is None else available
    if needed > available:
        raise ImpossibleRequestError(
            f"train.batch_size {train.batch_size} with {train.model} needs about {needed / GIB:.1f} GiB of memory "
            f"({bytes_per_image(train.model) / (1 << 20):.1f} MiB per image for activations, plus the runtime and "
            f"the data cache), more than the {available / GIB:.1f} GiB available: lower train.batch_size"
        )


def _check_devices(train: TrainConfig) -> None:
    """Asks TensorFlow for the devices only when GPUs or a cluster are requested (CPU runs need no import)."""
    if not train.gpus and not os.environ.get("TF_CONFIG"):
        return
    try:
        import_tensorflow()
        from cifar.distribute import plan_devices

        plan_devices(train)
    except ValueError as error:
        raise ImpossibleRequestError(f"train.gpus: {error}") from None
