"""Custom layers: the fused batch norm is Keras's batch norm (outputs, moving statistics, gradients)
in float32 and under mixed_bfloat16; the other layers do what the reference code did."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

from cifar.callbacks import batch_norm_recomputer
from cifar.layers import (
    ChannelPadding,
    FusedBatchNormalization,
    Gelu,
    LocalResponseNormalization,
    PartialDirac,
    PatchWhitening,
)

MOMENTUM = 0.9  # Far from 1 so a few steps move the moving statistics visibly.
EPSILON = 1e-3  # Keras's default; above the fused kernel's 1.001e-5 floor.
STEPS = 3  # Training steps compared before checking the moving statistics.


@pytest.fixture
def mixed_bfloat16():
    """Runs a test under the mixed_bfloat16 policy and always restores float32."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _batches(shape: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    """Inputs with a non-zero mean and non-unit variance per channel, so normalization matters."""
    rng = np.random.default_rng(seed)
    channels = shape[-1]
    return [
        (rng.normal(size=shape) * rng.uniform(0.5, 3.0, channels) + rng.uniform(-2.0, 2.0, channels)).astype("float32")
        for _ in range(STEPS)
    ]


def _pair(shape: tuple[int, ...], **kwargs) -> tuple[layers.Layer, layers.Layer]:
    """A Keras BatchNormalization and a FusedBatchNormalization built with identical random gamma/beta."""
    keras_bn = layers.BatchNormalization(momentum=MOMENTUM, epsilon=EPSILON, **kwargs)
    fused_bn = FusedBatchNormalization(momentum=MOMENTUM, epsilon=EPSILON, **kwargs)
    keras_bn.build(shape)
    fused_bn.build(shape)
    rng = np.random.default_rng(1)
    channels = shape[-1]
    for name in ("gamma", "beta"):
        if getattr(keras_bn, name) is not None:
            values = rng.uniform(0.5, 1.5, channels).astype("float32")
            getattr(keras_bn, name).assign(values)
            getattr(fused_bn, name).assign(values)
    return keras_bn, fused_bn


def _train_steps(layer: layers.Layer, batches: list[np.ndarray]):
    """Outputs and input/gamma/beta gradients of a weighted sum of outputs, for each training step."""
    results = []
    weights = tf.random.stateless_normal(batches[0].shape, seed=(3, 4))
    for batch in batches:
        inputs = tf.constant(batch)
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            outputs = layer(inputs, training=True)
            loss = tf.reduce_sum(tf.cast(outputs, tf.float32) * weights)
        variables = [variable.value for variable in layer.trainable_weights]
        gradients = tape.gradient(loss, [inputs, *variables])
        results.append((outputs, gradients))
    return results


def _assert_matches(keras_bn, fused_bn, batches, tolerance: float) -> None:
    keras_steps = _train_steps(keras_bn, batches)
    fused_steps = _train_steps(fused_bn, batches)
    for (keras_out, keras_grads), (fused_out, fused_grads) in zip(keras_steps, fused_steps):
        assert fused_out.dtype == keras_out.dtype
        np.testing.assert_allclose(np.float32(fused_out), np.float32(keras_out), atol=tolerance, rtol=tolerance)
        assert len(fused_grads) == len(keras_grads)
        for keras_grad, fused_grad in zip(keras_grads, fused_grads):
            assert keras_grad is not None and fused_grad is not None
            scale = float(np.max(np.abs(np.float32(keras_grad)))) + 1.0
            np.testing.assert_allclose(np.float32(fused_grad), np.float32(keras_grad), atol=tolerance * scale, rtol=0)
    # The moving statistics after a few steps, and inference with them.
    np.testing.assert_allclose(fused_bn.moving_mean.numpy(), keras_bn.moving_mean.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        fused_bn.moving_variance.numpy(), keras_bn.moving_variance.numpy(), rtol=10 * tolerance, atol=1e-5
    )
    assert not np.allclose(keras_bn.moving_mean.numpy(), 0.0), "the moving mean should have moved"
    inference_input = batches[0][: max(1, len(batches[0]) // 2)]
    np.testing.assert_allclose(
        np.float32(fused_bn(inference_input, training=False)),
        np.float32(keras_bn(inference_input, training=False)),
        atol=tolerance,
        rtol=tolerance,
    )


@pytest.mark.parametrize("shape", [(8, 6, 6, 5), (16, 7)])
@pytest.mark.parametrize("center,scale", [(True, True), (True, False), (False, True)])
def test_fused_batchnorm_matches_keras_in_float32(shape, center, scale):
    keras_bn, fused_bn = _pair(shape, center=center, scale=scale)
    _assert_matches(keras_bn, fused_bn, _batches(shape), tolerance=1e-4)


def test_fused_batchnorm_matches_keras_under_mixed_bfloat16(mixed_bfloat16):
    shape = (8, 6, 6, 5)
    keras_bn, fused_bn = _pair(shape)
    assert fused_bn.compute_dtype == "bfloat16" and fused_bn.moving_mean.dtype == "float32"
    # bfloat16 has an 8-bit mantissa: outputs of magnitude ~3 round to within ~0.016.
    _assert_matches(keras_bn, fused_bn, _batches(shape), tolerance=3e-2)


def test_fused_batchnorm_moving_variance_is_the_biased_batch_variance():
    batch = _batches((4, 3, 3, 2))[0]
    layer = FusedBatchNormalization(momentum=0.0)  # The moving statistics become the last batch's.
    layer(batch, training=True)
    np.testing.assert_allclose(layer.moving_mean.numpy(), batch.mean(axis=(0, 1, 2)), rtol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), batch.var(axis=(0, 1, 2)), rtol=1e-4)


def test_fused_batchnorm_frozen_layer_runs_in_inference_mode():
    batch = _batches((4, 3, 3, 2))[0]
    layer = FusedBatchNormalization(momentum=0.0)
    layer.build(batch.shape)
    layer.trainable = False
    outputs = layer(batch, training=True)
    np.testing.assert_array_equal(layer.moving_mean.numpy(), np.zeros(2, np.float32))
    np.testing.assert_allclose(outputs, batch / np.sqrt(1.0 + 1e-3), rtol=1e-5)


def test_fused_batchnorm_rejects_bad_arguments():
    with pytest.raises(ValueError, match="last"):
        FusedBatchNormalization(axis=1)
    with pytest.raises(ValueError, match="epsilon"):
        FusedBatchNormalization(epsilon=0.0)
    with pytest.raises(ValueError, match="momentum"):
        FusedBatchNormalization(momentum=1.5)


def test_fused_batchnorm_config_round_trip():
    layer = FusedBatchNormalization(momentum=0.6, epsilon=1e-5, scale=False, name="bn")
    clone = FusedBatchNormalization.from_config(layer.get_config())
    assert (clone.momentum, clone.epsilon, clone.scale, clone.center, clone.name) == (0.6, 1e-5, False, True, "bn")
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == "cifar>FusedBatchNormalization"


def test_local_response_normalization_matches_formula():
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(2, 3, 3, 9)).astype("float32")
    layer = LocalResponseNormalization(depth_radius=2, bias=1.0, alpha=0.5, beta=0.75)
    padded = np.pad(inputs**2, [(0, 0), (0, 0), (0, 0), (2, 2)])
    square_sum = sum(padded[..., offset : offset + 9] for offset in range(5))
    np.testing.assert_allclose(layer(inputs), inputs / (1.0 + 0.5 * square_sum) ** 0.75, rtol=1e-5)


def test_local_response_normalization_under_mixed_bfloat16(mixed_bfloat16):
    # TensorFlow has no bfloat16 LRN kernel on CPU; the layer computes in float32 and casts back.
    inputs = np.random.default_rng(0).normal(size=(2, 4, 4, 8)).astype("float32")
    layer = LocalResponseNormalization(depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75)
    outputs = layer(inputs)
    assert outputs.dtype == tf.bfloat16
    expected = tf.nn.local_response_normalization(inputs, 4, bias=1.0, alpha=0.001 / 9.0, beta=0.75)
    np.testing.assert_allclose(np.float32(outputs), expected, atol=2e-2)


def test_patch_whitening_defaults_to_the_identity_basis_with_both_signs():
    inputs = np.random.default_rng(0).normal(size=(2, 5, 5, 3)).astype("float32")
    layer = PatchWhitening(patch_size=2)
    outputs = np.asarray(layer(inputs))
    assert outputs.shape == (2, 4, 4, 24)
    assert [weight.name for weight in layer.trainable_weights] == ["bias"]
    # Filter 0 picks the top-left pixel's first channel; filter 12 is its negation.
    np.testing.assert_allclose(outputs[..., 0], inputs[:, :4, :4, 0], rtol=1e-6)
    np.testing.assert_allclose(outputs[..., 12], -inputs[:, :4, :4, 0], rtol=1e-6)
    # Filter 3 is the pixel to the right (patch order: row, column, channel).
    np.testing.assert_allclose(outputs[..., 3], inputs[:, :4, 1:, 0], rtol=1e-6)


def test_channel_padding_pads_evenly_with_zeros():
    inputs = np.ones((1, 2, 2, 16), np.float32)
    outputs = np.asarray(ChannelPadding(8, 8)(inputs))
    assert outputs.shape == (1, 2, 2, 32)
    np.testing.assert_array_equal(outputs[..., 8:24], 1.0)
    assert outputs[..., :8].sum() == 0 and outputs[..., 24:].sum() == 0
    with pytest.raises(ValueError):
        ChannelPadding(-1, 0)


def test_partial_dirac_is_identity_on_the_first_filters():
    kernel = np.asarray(PartialDirac(seed=1)((3, 3, 4, 6)))
    identity = np.zeros((3, 3, 4, 4), np.float32)
    identity[1, 1, range(4), range(4)] = 1.0
    np.testing.assert_array_equal(kernel[..., :4], identity)
    bound = 1.0 / np.sqrt(3 * 3 * 4)  # PyTorch's default conv init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    assert np.all(np.abs(kernel[..., 4:]) <= bound) and np.std(kernel[..., 4:]) > bound / 4
    with pytest.raises(ValueError):
        PartialDirac()((3, 3))


@pytest.mark.parametrize("training", [True, False])
def test_gelu_is_the_exact_gelu_with_its_exact_gradient(training):
    # Both tails and the middle: erfc keeps Phi(x) accurate for large negative x.
    values = tf.constant(np.linspace(-9.0, 9.0, 181, dtype=np.float32).reshape(1, 181))
    layer = Gelu()
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(values)
        ours = layer(values, training=training)
        reference = keras.activations.gelu(values, approximate=False)
    np.testing.assert_allclose(ours.numpy(), reference.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        tape.gradient(ours, values).numpy(), tape.gradient(reference, values).numpy(), rtol=1e-4, atol=1e-6
    )


def test_gelu_under_mixed_bfloat16_rounds_only_its_output(mixed_bfloat16):
    values = tf.constant(np.linspace(-4.0, 4.0, 64, dtype=np.float32).reshape(1, 64))
    layer = Gelu()
    reference = keras.activations.gelu(values, approximate=False).numpy()
    for training in (True, False):
        with tf.GradientTape() as tape:
            tape.watch(values)
            outputs = layer(values, training=training)
        assert outputs.dtype == tf.bfloat16
        np.testing.assert_allclose(tf.cast(outputs, tf.float32).numpy(), reference, rtol=8e-3, atol=8e-3)
        assert tape.gradient(outputs, values).dtype == tf.float32


def _two_bn_model() -> keras.Model:
    """conv -> fused BN -> relu -> conv -> Keras BN -> logits: the second BN's input depends on the first."""
    inputs = keras.Input((8, 8, 3))
    x = layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv1")(inputs)
    x = FusedBatchNormalization(momentum=0.997, epsilon=EPSILON, name="bn1")(x)
    x = layers.ReLU()(x)
    x = layers.Conv2D(5, 3, padding="same", use_bias=False, name="conv2")(x)
    x = layers.BatchNormalization(momentum=0.997, epsilon=EPSILON, name="bn2")(x)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x))


def test_precise_bn_sets_each_layer_to_the_population_statistics_of_its_training_mode_input():
    keras.utils.set_random_seed(0)
    model = _two_bn_model()
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(6, 8, 8, 3)) * 2.0 + 1.0).astype("float32") for _ in range(3)]
    dataset = tf.data.Dataset.from_tensor_slices((np.concatenate(batches), np.zeros(18, "int32"))).batch(6)

    recompute = batch_norm_recomputer(model)
    assert recompute(dataset) == 18

    # The reference in NumPy: each batch normalised with its own statistics, as in training.
    conv1, conv2 = model.get_layer("conv1"), model.get_layer("conv2")
    bn1 = model.get_layer("bn1")
    first, second = [], []
    for batch in batches:
        x1 = conv1(batch).numpy()
        first.append(x1.reshape(-1, 4))
        mean, variance = x1.mean(axis=(0, 1, 2)), x1.var(axis=(0, 1, 2))
        y = (x1 - mean) / np.sqrt(variance + EPSILON) * bn1.gamma.numpy() + bn1.beta.numpy()
        second.append(conv2(np.maximum(y, 0.0)).numpy().reshape(-1, 5))
    for name, inputs in (("bn1", np.concatenate(first)), ("bn2", np.concatenate(second))):
        layer = model.get_layer(name)
        np.testing.assert_allclose(layer.moving_mean.numpy(), inputs.mean(axis=0), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(layer.moving_variance.numpy(), inputs.var(axis=0), rtol=1e-3, atol=1e-5)
    # Inference now uses those statistics: the moving ones are no longer the initial zeros and ones.
    assert not np.allclose(bn1.moving_variance.numpy(), 1.0)


def test_precise_bn_leaves_a_model_without_batch_norm_alone():
    inputs = keras.Input((8, 8, 3))
    model = keras.Model(inputs, layers.Dense(10)(layers.Flatten()(inputs)))
    assert batch_norm_recomputer(model) is None
