"""Custom Keras layers of the model zoo, each registered so `.keras` checkpoints reload.

Fused batch normalization and GELU (speed), the tutorial CNN's LRN, airbench's patch whitening and
convolution initializer, and the estimator's parameter-free ("option A") shortcut padding.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf
from keras import initializers, layers, ops

# cuDNN rejects a batch-norm epsilon below CUDNN_BN_MIN_EPSILON (1e-5); Keras 2's fused path clamped
# to this value for the same reason, so a model behaves the same on CPU and GPU.
FUSED_MIN_EPSILON = 1.001e-5

# The dtypes TensorFlow's FusedBatchNormV3 kernels accept for the activations (CPU and GPU alike).
_FUSED_INPUT_DTYPES = (tf.float32, tf.bfloat16, tf.float16)


@keras.saving.register_keras_serializable(package="cifar")
class FusedBatchNormalization(layers.Layer):
    """Batch normalization over the last axis computed by `tf.raw_ops.FusedBatchNormV3`.

    One oneDNN/cuDNN kernel: Keras 3's `BatchNormalization` on the TF backend is a dozen small ops
    (`tf.nn.moments`, `tf.nn.batch_normalization`, forward and backward), 35-55% of a ResNet-20 step on CPU.

    Numerically it is `keras.layers.BatchNormalization(axis=-1)`: in training it normalizes with
    the batch mean and the biased batch variance and updates
    `moving = moving * momentum + batch * (1 - momentum)` for both moving statistics (Keras's
    convention, also using the biased variance); in inference it uses the moving statistics. The
    fused kernel returns the Bessel-corrected (unbiased, divided by n - 1) batch variance in training
    mode, so it is scaled by (n - 1) / n before it enters the moving variance, as Keras 2's fused
    path did. Like Keras's layer, a frozen layer (`trainable=False`) always runs in inference mode.
    An epsilon below cuDNN's minimum is raised to `FUSED_MIN_EPSILON` (1.001e-5) when computing.

    Under a mixed policy the activations stay in the compute dtype (bfloat16/float16: the kernel
    accumulates statistics in float32 internally) while gamma, beta and the moving statistics stay
    float32, which is the (T, U) = (half type, float) form the kernel requires.
    """

    def __init__(
        self,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        moving_mean_initializer="zeros",
        moving_variance_initializer="ones",
        axis: int = -1,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if axis != -1:
            raise ValueError(f"FusedBatchNormalization normalizes the last (channels) axis only, got axis={axis}")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum}")
        if epsilon <= 0:
            raise ValueError(f"epsilon must be positive, got {epsilon}")
        self.axis = axis
        self.momentum = float(momentum)
        self.epsilon = float(epsilon)
        self.center = center
        self.scale = scale
        self.beta_initializer = initializers.get(beta_initializer)
        self.gamma_initializer = initializers.get(gamma_initializer)
        self.moving_mean_initializer = initializers.get(moving_mean_initializer)
        self.moving_variance_initializer = initializers.get(moving_variance_initializer)
        self.supports_masking = True

    def build(self, input_shape):
        if len(input_shape) < 2 or input_shape[-1] is None:
            raise ValueError(f"FusedBatchNormalization needs a known channel axis, got input shape {input_shape}")
        channels = int(input_shape[-1])
        # Statistics and affine parameters stay float32 under mixed precision (autocast=False),
        # exactly like Keras's BatchNormalization, and as the fused kernel requires.
        add = functools.partial(self.add_weight, shape=(channels,), autocast=False)
        self.gamma = add(name="gamma", initializer=self.gamma_initializer) if self.scale else None
        self.beta = add(name="beta", initializer=self.beta_initializer) if self.center else None
        self.moving_mean = add(name="moving_mean", initializer=self.moving_mean_initializer, trainable=False)
        self.moving_variance = add(
            name="moving_variance", initializer=self.moving_variance_initializer, trainable=False
        )
        self.input_spec = layers.InputSpec(min_ndim=2, axes={-1: channels})

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, inputs, training=None):
        inputs = tf.convert_to_tensor(inputs)
        channels = self.moving_mean.shape[0]
        # The kernel takes NHWC only; any other rank is viewed as (N*..., 1, 1, C), which reduces over
        # the same axes (all but the last) as Keras's layer does.
        rank = len(inputs.shape)
        x = inputs if rank == 4 else tf.reshape(inputs, [-1, 1, 1, channels])
        if x.dtype not in _FUSED_INPUT_DTYPES:
            x = tf.cast(x, tf.float32)

        scale = tf.convert_to_tensor(self.gamma) if self.scale else tf.ones((channels,), tf.float32)
        offset = tf.convert_to_tensor(self.beta) if self.center else tf.zeros((channels,), tf.float32)
        epsilon = max(self.epsilon, FUSED_MIN_EPSILON)
        fused = functools.partial(
            tf.raw_ops.FusedBatchNormV3, x=x, scale=scale, offset=offset, epsilon=epsilon, data_format="NHWC"
        )
        if training and self.trainable:
            empty = tf.constant([], tf.float32)
            outputs, batch_mean, batch_variance, *_ = fused(
                mean=empty, variance=empty, exponential_avg_factor=1.0, is_training=True
            )
            # Undo the kernel's Bessel correction: Keras averages the biased variance.
            count = tf.cast(tf.size(x, out_type=tf.int64) // channels, tf.float32)
            biased_variance = batch_variance * ((count - 1.0) / tf.maximum(count, 1.0))
            self.moving_mean.assign(self.moving_mean * self.momentum + batch_mean * (1.0 - self.momentum))
            self.moving_variance.assign(self.moving_variance * self.momentum + biased_variance * (1.0 - self.momentum))
        else:
            mean, variance = tf.convert_to_tensor(self.moving_mean), tf.convert_to_tensor(self.moving_variance)
            outputs = fused(mean=mean, variance=variance, is_training=False)[0]
        if rank != 4:
            outputs = tf.reshape(outputs, tf.shape(inputs))
        return tf.cast(outputs, self.compute_dtype)

    def get_config(self):
        config = {name: getattr(self, name) for name in ("axis", "momentum", "epsilon", "center", "scale")}
        for name in ("beta", "gamma", "moving_mean", "moving_variance"):
            config[f"{name}_initializer"] = initializers.serialize(getattr(self, f"{name}_initializer"))
        return {**super().get_config(), **config}


@keras.saving.register_keras_serializable(package="cifar")
class LocalResponseNormalization(layers.Layer):
    """`tf.nn.local_response_normalization` over the channel axis, as in the TF tutorial CNN.

    `output = x / (bias + alpha * sum(x[..., c - r : c + r + 1] ** 2)) ** beta` with r = depth_radius.
    TensorFlow's CPU kernel accepts float32/float16 only (no bfloat16) and the GPU kernel float32
    only, so the layer always computes in float32 and casts back to the compute dtype: the op is
    cheap next to the convolutions, and the float32 sum of squares cannot overflow.
    """

    def __init__(self, depth_radius: int = 5, bias: float = 1.0, alpha: float = 1.0, beta: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        if depth_radius < 0:
            raise ValueError(f"depth_radius must be >= 0, got {depth_radius}")
        self.depth_radius = int(depth_radius)
        self.bias = float(bias)
        self.alpha = float(alpha)
        self.beta = float(beta)

    def call(self, inputs):
        arguments = {name: getattr(self, name) for name in ("depth_radius", "bias", "alpha", "beta")}
        normalized = tf.nn.local_response_normalization(tf.cast(inputs, tf.float32), **arguments)
        return tf.cast(normalized, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        arguments = {name: getattr(self, name) for name in ("depth_radius", "bias", "alpha", "beta")}
        return {**super().get_config(), **arguments}


@keras.saving.register_keras_serializable(package="cifar")
class PatchWhitening(layers.Layer):
    """airbench's first layer: a 'valid' convolution with frozen filters and a trainable bias.

    It has `2 * patch_size**2 * channels` filters: the whitening basis W of the image patches and
    its negation -W, so the GELU after it keeps both signs of every whitened component (airbench94).
    The filters are not trained; `cifar.models.init_whitening` computes them from training images.
    Until then they are the identity basis (each filter picks one pixel value of the patch, with
    both signs), which is the whitening of patches whose covariance is the identity.
    """

    def __init__(self, patch_size: int = 2, **kwargs):
        super().__init__(**kwargs)
        if patch_size < 1:
            raise ValueError(f"patch_size must be >= 1, got {patch_size}")
        self.patch_size = int(patch_size)

    def build(self, input_shape):
        channels = input_shape[-1]
        if channels is None:
            raise ValueError(f"PatchWhitening needs a known channel axis, got input shape {input_shape}")
        patch_values = self.patch_size * self.patch_size * int(channels)
        self.filters = 2 * patch_values

        def identity_basis(shape, dtype=None):
            basis = ops.eye(patch_values, dtype=dtype)  # (values, values): one filter per patch value.
            return ops.reshape(ops.concatenate([basis, -basis], axis=1), shape)

        kernel_shape = (self.patch_size, self.patch_size, int(channels), self.filters)
        self.kernel = self.add_weight(shape=kernel_shape, name="kernel", initializer=identity_basis, trainable=False)
        self.bias = self.add_weight(shape=(self.filters,), name="bias", initializer="zeros")

    def call(self, inputs):
        # The kernel and bias read as the compute dtype here (Keras autocasts float variables).
        outputs = ops.conv(inputs, self.kernel, strides=1, padding="valid")
        return outputs + self.bias

    def compute_output_shape(self, input_shape):
        batch, height, width, channels = input_shape
        height, width = (None if size is None else size - self.patch_size + 1 for size in (height, width))
        return (batch, height, width, 2 * self.patch_size * self.patch_size * channels)

    def get_config(self):
        return {**super().get_config(), "patch_size": self.patch_size}


_SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2).
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 pi), the standard normal density at 0.


def _gelu_float32(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(x as float32, Phi(x)): the standard normal CDF via erfc, accurate in both tails."""
    x = tf.cast(x, tf.float32)
    return x, 0.5 * tf.math.erfc(-x * _SQRT_HALF)


@tf.function(jit_compile=True, reduce_retracing=True)
def _fused_gelu_forward(x: tf.Tensor) -> tf.Tensor:
    x32, cdf = _gelu_float32(x)
    return tf.cast(x32 * cdf, x.dtype)


@tf.function(jit_compile=True, reduce_retracing=True)
def _fused_gelu_backward(x: tf.Tensor, upstream: tf.Tensor) -> tf.Tensor:
    # d/dx [x Phi(x)] = Phi(x) + x phi(x).
    x32, cdf = _gelu_float32(x)
    derivative = cdf + x32 * tf.exp(-0.5 * tf.square(x32)) * _INV_SQRT_2PI
    return tf.cast(tf.cast(upstream, tf.float32) * derivative, x.dtype)


@tf.custom_gradient
def fused_gelu(x: tf.Tensor):
    """Exact GELU, x * Phi(x), in float32 math; forward and gradient are each one fused XLA kernel."""
    return _fused_gelu_forward(x), lambda upstream: _fused_gelu_backward(x, upstream)


@keras.saving.register_keras_serializable(package="cifar")
class Gelu(layers.Layer):
    """The exact (erf) GELU, PyTorch's default, computed in float32 whatever the compute dtype.

    In training the forward pass and the gradient are each one XLA-fused kernel (`fused_gelu`):
    on CPU, Keras's bfloat16 GELU runs ~12 separate elementwise passes (erfc, exp, squares,
    products) and was ~6x slower, as slow as all the fast net's convolutions together. Inference
    (evaluation, export, serving) uses plain TensorFlow ops, so an exported SavedModel needs no XLA.
    """

    def call(self, inputs, training=None):
        if training:
            return fused_gelu(inputs)
        x32, cdf = _gelu_float32(inputs)
        return tf.cast(x32 * cdf, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return input_shape


@keras.saving.register_keras_serializable(package="cifar")
class ChannelPadding(layers.Layer):
    """Zero channels added before and after the last axis: the estimator's 'option A' shortcut."""

    def __init__(self, before: int, after: int, **kwargs):
        super().__init__(**kwargs)
        if before < 0 or after < 0:
            raise ValueError(f"channel padding must be >= 0, got before={before}, after={after}")
        self.before = int(before)
        self.after = int(after)

    def call(self, inputs):
        padding = [[0, 0]] * (len(inputs.shape) - 1) + [[self.before, self.after]]
        return ops.pad(inputs, padding)

    def compute_output_shape(self, input_shape):
        channels = input_shape[-1]
        return (*input_shape[:-1], None if channels is None else channels + self.before + self.after)

    def get_config(self):
        return {**super().get_config(), "before": self.before, "after": self.after}


@keras.saving.register_keras_serializable(package="cifar")
class PartialDirac(initializers.Initializer):
    """airbench's conv init: PyTorch's default uniform init, then identity on the first in-many filters.

    PyTorch's default is kaiming_uniform(a=sqrt(5)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), which is
    Keras's VarianceScaling(scale=1/3, mode="fan_in", distribution="uniform"). airbench then applies
    `dirac_` to the first `in_channels` output filters so each block starts close to passing its
    input through, which it found trains faster.
    """

    def __init__(self, seed: int | None = None):
        self.seed = seed
        self._uniform = initializers.VarianceScaling(scale=1.0 / 3.0, mode="fan_in", distribution="uniform", seed=seed)

    def __call__(self, shape, dtype=None):
        if len(shape) != 4:
            raise ValueError(f"PartialDirac initializes 2-D convolution kernels (4 dims), got shape {shape}")
        kernel_height, kernel_width, in_channels, out_channels = shape
        values = self._uniform(shape, dtype=dtype)
        identity_count = min(in_channels, out_channels)
        # A kernel that is 1 at the centre tap, for input channel i -> output channel i.
        centre = [[kernel_height // 2, kernel_width // 2, index, index] for index in range(identity_count)]
        dirac = tf.scatter_nd(centre, tf.ones((identity_count,), values.dtype), shape)
        is_identity_filter = tf.reshape(tf.range(out_channels) < identity_count, (1, 1, 1, out_channels))
        return tf.where(is_identity_filter, dirac, values)

    def get_config(self):
        return {"seed": self.seed}
