"""Model zoo: Keras Functional models looked up by name (`build_model`).

Every model takes raw pixels (0..255) and normalizes them in its first layer with the training split's
mean/std, so training, evaluation and serving cannot disagree; it returns float32 logits (N, 10) and
carries no regularizer (training adds the L2 penalty). The models: docs/ARCHITECTURE.md ("Model contract").
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import keras
import numpy as np
from keras import layers

from cifar.data.manifest import NUM_CLASSES
from cifar.layers import (
    ChannelPadding,
    FusedBatchNormalization,
    Gelu,
    LocalResponseNormalization,
    PartialDirac,
    PatchWhitening,
)
from cifar.names import parse_model_name


def input_size(name: str) -> int:
    """Side length of the images the model is trained on (the tutorial CNN uses 24x24 crops)."""
    return 24 if name == "tutorial" else 32


def normalized_input(
    size: int, mean: Sequence[float], std: Sequence[float]
) -> tuple[keras.KerasTensor, keras.KerasTensor]:
    """The raw-pixel input and its normalized float tensor: (x / 255 - mean) / std per channel."""
    inputs = keras.Input(shape=(size, size, 3), name="image")
    scaled = layers.Rescaling(1.0 / 255.0, name="scale")(inputs)
    normalized = layers.Normalization(
        mean=[float(value) for value in mean], variance=[float(value) ** 2 for value in std], axis=-1, name="normalize"
    )(scaled)
    return inputs, normalized


def logits_head(features: keras.KerasTensor, output_scale: float | None = None, **dense: object) -> keras.KerasTensor:
    """The final dense layer (`dense`: its keyword arguments), in float32 so mixed precision never rounds the logits.

    The output layer is always named "logits". With `output_scale` the dense layer is named
    "classifier" and a constant float32 multiplication named "logits" follows it (airbench's 1/9).
    """
    dense_name = "logits" if output_scale is None else "classifier"
    logits = layers.Dense(NUM_CLASSES, dtype="float32", name=dense_name, **dense)(features)
    if output_scale is not None:
        logits = layers.Rescaling(output_scale, dtype="float32", name="logits")(logits)
    return logits


def fused_layers(name: str) -> frozenset[str]:
    """The layers of the named model that have a fused variant: "batchnorm" (ResNets, the fast net), "gelu" (fast)."""
    family, _ = parse_model_name(name)
    return frozenset({"resnet": {"batchnorm"}, "fast": {"batchnorm", "gelu"}}.get(family, ()))


def batch_norm(fused: bool, *, momentum: float, epsilon: float, scale: bool = True, name: str) -> layers.Layer:
    """Batch normalization over channels: the fused-kernel layer or Keras's own, same numerics."""
    if fused:
        return FusedBatchNormalization(momentum=momentum, epsilon=epsilon, scale=scale, name=name)
    return layers.BatchNormalization(momentum=momentum, epsilon=epsilon, scale=scale, name=name)


def build_tiny(mean: Sequence[float], std: Sequence[float], **_: object) -> keras.Model:
    """For testing only: one small conv layer, trains in seconds on the fixture archives."""
    inputs, x = normalized_input(32, mean, std)
    x = layers.Conv2D(8, 3, strides=2, padding="same", activation="relu", name="conv")(x)  # (B, 16, 16, 8)
    x = layers.GlobalAveragePooling2D(name="pool")(x)  # (B, 8)
    return keras.Model(inputs, logits_head(x), name="tiny")


# The TF tutorial CNN (tensorflow/models tutorials/image/cifar10/cifar10.py, `inference`).
TUTORIAL_CONV_STDDEV = 5e-2  # Truncated-normal std of both 5x5 conv kernels.
TUTORIAL_DENSE_STDDEV = 0.04  # Truncated-normal std of the 384- and 192-unit layers.
TUTORIAL_LRN = {"depth_radius": 4, "bias": 1.0, "alpha": 0.001 / 9.0, "beta": 0.75}  # tf.nn.lrn arguments.


def build_tutorial(mean: Sequence[float], std: Sequence[float], **_: object) -> keras.Model:
    """The classic TF tutorial CNN on 24x24 crops: two conv-pool-LRN stages and two dense layers.

    Initializers follow the tutorial exactly (truncated normals, biases 0 / 0.1); its weight decay
    (0.004 on the dense kernels) is training's L2 penalty (`cifar.train.add_weight_decay`). It has
    no batch norm, so `fused_batchnorm` does not apply.
    """
    conv_init = keras.initializers.TruncatedNormal(stddev=TUTORIAL_CONV_STDDEV)
    dense_init = keras.initializers.TruncatedNormal(stddev=TUTORIAL_DENSE_STDDEV)
    bias_init = keras.initializers.Constant(0.1)
    conv = functools.partial(layers.Conv2D, 64, 5, padding="same", activation="relu", kernel_initializer=conv_init)
    inputs, x = normalized_input(24, mean, std)
    x = conv(name="conv1")(x)
    x = layers.MaxPooling2D(3, strides=2, padding="same", name="pool1")(x)  # (B, 12, 12, 64)
    x = LocalResponseNormalization(**TUTORIAL_LRN, name="norm1")(x)
    x = conv(bias_initializer=bias_init, name="conv2")(x)
    # The tutorial normalizes before pooling in the second stage (the reverse of the first).
    x = LocalResponseNormalization(**TUTORIAL_LRN, name="norm2")(x)
    x = layers.MaxPooling2D(3, strides=2, padding="same", name="pool2")(x)  # (B, 6, 6, 64)
    x = layers.Flatten(name="flatten")(x)  # (B, 2304)
    for units, name in ((384, "local3"), (192, "local4")):
        x = layers.Dense(
            units, activation="relu", kernel_initializer=dense_init, bias_initializer=bias_init, name=name
        )(x)
    logits = logits_head(x, kernel_initializer=keras.initializers.TruncatedNormal(stddev=1.0 / 192.0))
    return keras.Model(inputs, logits, name="tutorial")


# ResNet v1 as in tensorflow/models tutorials/image/cifar10_estimator (cifar10_model.py, model_base.py).
RESNET_STAGE_FILTERS = (16, 32, 64)  # Filters of the three stages; the stem has 16.
RESNET_BN_MOMENTUM = 0.997  # The estimator's --batch-norm-decay (Keras momentum has the same meaning).
RESNET_BN_EPSILON = 1e-5  # The estimator's --batch-norm-epsilon.


def resnet_depth_blocks(depth: int) -> int:
    """Residual blocks per stage, n, for a CIFAR ResNet of depth 6n + 2; ValueError otherwise."""
    parse_model_name(f"resnet{depth}")
    return (depth - 2) // 6


def _resnet_conv(x: keras.KerasTensor, filters: int, strides: int, name: str) -> keras.KerasTensor:
    """3x3 conv without bias (batch norm follows), as the estimator's `_conv`.

    A strided conv pads 1 pixel on every side and uses 'valid', like the estimator, rather than TF's
    asymmetric 'same' padding. Keras's default glorot-uniform kernel init is also tf.layers' default.
    """
    if strides > 1:
        x = layers.ZeroPadding2D(1, name=f"{name}_pad")(x)
    return layers.Conv2D(
        filters, 3, strides=strides, padding="valid" if strides > 1 else "same", use_bias=False, name=name
    )(x)


def _residual_block(
    x: keras.KerasTensor, in_filters: int, filters: int, strides: int, fused: bool, name: str
) -> keras.KerasTensor:
    """Post-activation basic block: conv-BN-ReLU-conv-BN, add the shortcut, ReLU (`_residual_v1`)."""
    shortcut = x
    x = _resnet_conv(x, filters, strides, f"{name}_conv1")
    x = batch_norm(fused, momentum=RESNET_BN_MOMENTUM, epsilon=RESNET_BN_EPSILON, name=f"{name}_bn1")(x)
    x = layers.ReLU(name=f"{name}_relu1")(x)
    x = _resnet_conv(x, filters, 1, f"{name}_conv2")
    x = batch_norm(fused, momentum=RESNET_BN_MOMENTUM, epsilon=RESNET_BN_EPSILON, name=f"{name}_bn2")(x)
    if in_filters != filters:
        # The estimator's parameter-free shortcut ("option A" of He et al. 2015): average-pool by the
        # stride, then zero-pad the channels evenly on both sides.
        pool = layers.AveragePooling2D(strides, strides=strides, padding="same", name=f"{name}_shortcut_pool")
        shortcut = pool(shortcut)
        padding = (filters - in_filters) // 2
        shortcut = ChannelPadding(padding, filters - in_filters - padding, name=f"{name}_shortcut_pad")(shortcut)
    x = layers.Add(name=f"{name}_add")([x, shortcut])
    return layers.ReLU(name=f"{name}_relu2")(x)


def build_resnet(
    mean: Sequence[float], std: Sequence[float], *, depth: int, fused_batchnorm: bool = True, **_: object
) -> keras.Model:
    """ResNet v1 for CIFAR of depth 6n + 2: stem conv-BN-ReLU, 3 stages of n blocks, GAP, dense 10.

    The estimator scaled pixels as x / 128 - 1; here the manifest's mean/std normalization does that
    job. Its dense layer had 11 outputs ("in case labels start at 1"); ours has the 10 classes.
    """
    blocks = resnet_depth_blocks(depth)
    inputs, x = normalized_input(32, mean, std)
    x = _resnet_conv(x, 16, 1, "stem_conv")
    x = batch_norm(fused_batchnorm, momentum=RESNET_BN_MOMENTUM, epsilon=RESNET_BN_EPSILON, name="stem_bn")(x)
    x = layers.ReLU(name="stem_relu")(x)  # (B, 32, 32, 16)
    in_filters = 16
    for stage, filters in enumerate(RESNET_STAGE_FILTERS, start=1):
        for block in range(1, blocks + 1):
            # Stages 2 and 3 halve the resolution in their first block: 32 -> 16 -> 8.
            strides = 2 if stage > 1 and block == 1 else 1
            x = _residual_block(x, in_filters, filters, strides, fused_batchnorm, name=f"stage{stage}_block{block}")
            in_filters = filters
    x = layers.GlobalAveragePooling2D(name="pool")(x)  # (B, 64)
    return keras.Model(inputs, logits_head(x), name=f"resnet{depth}")


# The time-to-accuracy net of airbench94 (KellerJordan/cifar10-airbench, airbench94.py `make_net`),
# itself descended from Page's ResNet-9 (DAWNBench) and tysam-code's hlb-CIFAR10.
FAST_WIDTHS = (64, 256, 256)  # airbench94 hyp['net']['widths'] block1/block2/block3.
FAST_WHITENING_PATCH = 2  # airbench94 whiten_kernel_size: 2x2 patches -> 24 whitening filters.
FAST_BN_MOMENTUM = 0.6  # airbench94 batchnorm_momentum (PyTorch momentum 0.4 = 1 - 0.6).
# airbench uses eps=1e-12; the fused kernel (cuDNN) needs >= 1e-5, negligible next to unit variances.
FAST_BN_EPSILON = 1e-5
FAST_OUTPUT_SCALE = 1.0 / 9.0  # airbench94 scaling_factor: logits = (features @ W) / 9.
WHITENING_EPSILON = 5e-4  # airbench94 init_whitening_conv eps added to the eigenvalues.
WHITENING_IMAGES = 5000  # airbench94 whitens with the first 5,000 training images.


def gelu(fused: bool, name: str) -> layers.Layer:
    """Exact GELU: ours with XLA-fused training kernels, or Keras's own (same numerics)."""
    return Gelu(name=name) if fused else layers.Activation("gelu", name=name)


def _fast_conv_group(x: keras.KerasTensor, filters: int, fused: bool, fused_gelu: bool, name: str) -> keras.KerasTensor:
    """airbench's ConvGroup: conv-pool-BN-GELU-conv-BN-GELU, convs without bias, BN without scale."""
    # airbench freezes the BN weight at 1 (only the bias trains), i.e. scale=False.
    bn = functools.partial(batch_norm, fused, momentum=FAST_BN_MOMENTUM, epsilon=FAST_BN_EPSILON, scale=False)
    for index in (1, 2):
        x = layers.Conv2D(
            filters, 3, padding="same", use_bias=False, kernel_initializer=PartialDirac(), name=f"{name}_conv{index}"
        )(x)
        if index == 1:
            # Pooling right after the first conv halves the work of everything that follows.
            x = layers.MaxPooling2D(2, name=f"{name}_pool")(x)
        x = bn(name=f"{name}_bn{index}")(x)
        x = gelu(fused_gelu, f"{name}_gelu{index}")(x)  # Exact (erf) GELU, PyTorch's default.
    return x


def build_fast(
    mean: Sequence[float], std: Sequence[float], *, fused_batchnorm: bool = True, fused_gelu: bool = True, **_: object
) -> keras.Model:
    """airbench94's net: frozen 2x2 patch whitening, three conv groups 64/256/256, global max pool.

    Call `init_whitening(model, train_images)` before training to set the whitening filters from
    data. airbench trains the whitening bias for the first 3 epochs only (`train.whitening_bias_epochs`).
    """
    inputs, x = normalized_input(32, mean, std)
    x = PatchWhitening(FAST_WHITENING_PATCH, name="whitening")(x)  # (B, 31, 31, 24)
    x = gelu(fused_gelu, "whitening_gelu")(x)
    for index, filters in enumerate(FAST_WIDTHS, start=1):
        x = _fast_conv_group(x, filters, fused_batchnorm, fused_gelu, name=f"group{index}")  # 31 -> 15 -> 7 -> 3
    x = layers.GlobalMaxPooling2D(name="pool")(x)  # (B, 256): airbench's MaxPool2d(3) on the 3x3 map.
    # PyTorch's default Linear init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as airbench's classifier has.
    torch_linear_init = keras.initializers.VarianceScaling(scale=1.0 / 3.0, mode="fan_in", distribution="uniform")
    logits = logits_head(x, FAST_OUTPUT_SCALE, use_bias=False, kernel_initializer=torch_linear_init)
    return keras.Model(inputs, logits, name="fast")


def patch_second_moments(images: np.ndarray, patch_size: int, chunk_size: int = 500) -> np.ndarray:
    """E[p p^T] over every k x k patch p of the images (float64), p ordered (row, column, channel).

    That order is a conv kernel's (k, k, C) flattened, so eigenvectors reshape straight into filters.
    Computed from shifted views, a chunk of images at a time, instead of materializing all patches
    (5,000 images have 4.8M patches: 460 MB as float64).
    """
    count, height, width, channels = images.shape
    out_height, out_width = height - patch_size + 1, width - patch_size + 1
    offsets = [(row, column) for row in range(patch_size) for column in range(patch_size)]
    moments = np.zeros((len(offsets), channels, len(offsets), channels))
    for start in range(0, count, chunk_size):
        block = np.asarray(images[start : start + chunk_size], dtype=np.float64)
        # One (pixels, C) matrix per position inside the patch.
        shifted = [
            block[:, row : row + out_height, column : column + out_width, :].reshape(-1, channels)
            for row, column in offsets
        ]
        for first, left in enumerate(shifted):
            for second, right in enumerate(shifted):
                moments[first, :, second, :] += left.T @ right
    size = len(offsets) * channels
    return moments.reshape(size, size) / (count * out_height * out_width)


def init_whitening(model: keras.Model, images_uint8: np.ndarray) -> np.ndarray:
    """Sets the model's `PatchWhitening` filters from training images; returns the eigenvalues.

    As airbench94's `init_whitening_conv`: the (uncentered) covariance of all k x k patches of the
    first `WHITENING_IMAGES` normalized images is eigen-decomposed, and the filters are the eigenvectors
    scaled by 1 / sqrt(eigenvalue + WHITENING_EPSILON), largest first, followed by their negations. The
    whitened patch components then have (nearly) unit second moments and are mutually uncorrelated.
    """
    images_uint8 = np.asarray(images_uint8)
    if images_uint8.ndim != 4 or images_uint8.shape[-1] != 3 or len(images_uint8) == 0:
        raise ValueError(f"images must be a non-empty (N, H, W, 3) array, got shape {images_uint8.shape}")
    whitening = next((layer for layer in model.layers if isinstance(layer, PatchWhitening)), None)
    if whitening is None:
        raise ValueError(f"model {model.name!r} has no PatchWhitening layer to initialize")
    # The filters see what the layer sees: the model's own rescaling and normalization, computed
    # here in float32 (calling the layers would round to bfloat16 under a mixed policy).
    scale = model.get_layer("scale").get_config()
    normalize = model.get_layer("normalize").get_config()
    images = images_uint8[:WHITENING_IMAGES].astype(np.float32)
    images = images * np.float32(scale["scale"]) + np.float32(scale["offset"])
    images = (images - np.float32(normalize["mean"])) / np.sqrt(np.float32(normalize["variance"]))
    covariance = patch_second_moments(images, whitening.patch_size)  # (k*k*3, k*k*3)
    eigenvalues, eigenvectors = np.linalg.eigh(covariance)  # Ascending order.
    eigenvalues, eigenvectors = eigenvalues[::-1], eigenvectors[:, ::-1]
    filters = eigenvectors / np.sqrt(eigenvalues + WHITENING_EPSILON)  # (k*k*3, k*k*3), one filter per column.
    kernel = np.concatenate([filters, -filters], axis=1).reshape(whitening.kernel.shape)
    whitening.kernel.assign(kernel.astype(np.float32))
    return eigenvalues


def build_model(
    name: str,
    *,
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.25, 0.25, 0.25),
    fused_batchnorm: bool = True,
    fused_gelu: bool = True,
) -> keras.Model:
    """Builds the named model. `mean`/`std` are per channel on the 0..1 scale (from the manifest).

    `fused_batchnorm` picks `cifar.layers.FusedBatchNormalization` over Keras's BatchNormalization
    (same numerics, one fused kernel); models without batch norm ignore it. `fused_gelu` picks
    `cifar.layers.Gelu` (XLA-fused training kernels) over Keras's GELU in the fast net. Set the mixed-precision
    policy (`cifar.performance.configure_performance`) before calling this.
    """
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError(f"mean and std need 3 channels with std > 0, got mean={mean}, std={std}")
    if not (isinstance(fused_batchnorm, bool) and isinstance(fused_gelu, bool)):  # "auto" is chosen before.
        raise ValueError(f"fused_batchnorm and fused_gelu must be booleans, got {fused_batchnorm!r}, {fused_gelu!r}")
    family, depth = parse_model_name(name)
    if family == "resnet":
        return build_resnet(mean, std, depth=depth, fused_batchnorm=fused_batchnorm)
    builder = {"tiny": build_tiny, "tutorial": build_tutorial, "fast": build_fast}[family]
    return builder(mean, std, fused_batchnorm=fused_batchnorm, fused_gelu=fused_gelu)
