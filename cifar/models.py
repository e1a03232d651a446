"""Model zoo: Keras Functional models looked up by name.

Every model takes raw pixels (uint8 or float, 0..255, shape (size, size, 3)) and normalizes them
inside the graph with the training split's per-channel mean/std, so training, evaluation and
serving can never disagree about preprocessing. Every model returns float32 logits (N, 10).
"""

from __future__ import annotations

from typing import Callable, Sequence

import keras
from keras import layers

NUM_CLASSES = 10

ModelBuilder = Callable[..., keras.Model]
_BUILDERS: dict[str, ModelBuilder] = {}


def register(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator adding a builder to the zoo under `name`."""

    def decorate(builder: ModelBuilder) -> ModelBuilder:
        _BUILDERS[name] = builder
        return builder

    return decorate


def input_size(name: str) -> int:
    """Side length of the images the model is trained on (the tutorial CNN uses 24x24 crops)."""
    return 24 if name == "tutorial" else 32


def normalized_input(size: int, mean: Sequence[float], std: Sequence[float]) -> tuple[keras.KerasTensor, keras.KerasTensor]:
    """The raw-pixel input and its normalized float tensor: (x / 255 - mean) / std per channel."""
    inputs = keras.Input(shape=(size, size, 3), name="image")
    scaled = layers.Rescaling(1.0 / 255.0, name="scale")(inputs)
    normalized = layers.Normalization(
        mean=list(mean), variance=[value**2 for value in std], axis=-1, name="normalize"
    )(scaled)
    return inputs, normalized


def logits_head(features: keras.KerasTensor, num_classes: int = NUM_CLASSES) -> keras.KerasTensor:
    """The final dense layer, kept in float32 so mixed precision never rounds the logits."""
    return layers.Dense(num_classes, dtype="float32", name="logits")(features)


@register("tiny")
def build_tiny(mean: Sequence[float], std: Sequence[float], **_: object) -> keras.Model:
    """For testing only: one small conv layer, trains in seconds on the fixture archives."""
    inputs, x = normalized_input(32, mean, std)
    x = layers.Conv2D(8, 3, strides=2, padding="same", activation="relu", name="conv")(x)  # (B, 16, 16, 8)
    x = layers.GlobalAveragePooling2D(name="pool")(x)  # (B, 8)
    return keras.Model(inputs, logits_head(x), name="tiny")


def build_model(
    name: str,
    *,
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.25, 0.25, 0.25),
    fused_batchnorm: bool = True,
) -> keras.Model:
    """Builds the named model. `mean`/`std` are per channel on the 0..1 scale (from the manifest)."""
    if name.startswith("resnet") and name not in _BUILDERS and "resnet" in _BUILDERS:
        return _BUILDERS["resnet"](mean=mean, std=std, fused_batchnorm=fused_batchnorm, depth=int(name[6:]))
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}: expected one of {', '.join(sorted(_BUILDERS))}")
    return _BUILDERS[name](mean=mean, std=std, fused_batchnorm=fused_batchnorm)
