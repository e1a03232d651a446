"""The model zoo: exact parameter counts, shapes of one forward pass and one training step on mock
data with fixed seeds, the reference architectures' structure, and `.keras` round trips."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from cifar.layers import FusedBatchNormalization, PatchWhitening
from cifar.models import build_model, init_whitening, input_size, patch_second_moments, resnet_depth_blocks

# model.count_params(): every weight, including batch norm's moving statistics and the frozen
# whitening filters. Same with or without the fused batch norm.
PARAMETER_COUNTS = {
    "tiny": 314,
    "tutorial": 1_068_298,  # 4,864 + 102,464 (convs) + 885,120 + 73,920 (dense) + 1,930 (logits).
    "resnet20": 271_098,  # 269,722 trainable: the paper's "0.27M".
    "resnet32": 466_426,
    "resnet56": 857_082,
    "fast": 1_973_944,  # airbench94's ~1.97M.
}
BATCH = 4  # Mock batch size.


@pytest.fixture
def mixed_bfloat16():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def mock_batch(name: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw uint8 pixels and labels, the input pipeline's contract."""
    rng = np.random.default_rng(seed)
    size = input_size(name)
    images = rng.integers(0, 256, size=(BATCH, size, size, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=(BATCH,), dtype=np.int32)
    return images, labels


@pytest.mark.parametrize("name,expected", sorted(PARAMETER_COUNTS.items()))
def test_parameter_counts(name, expected):
    model = build_model(name, fused_batchnorm=True)
    assert model.count_params() == expected
    assert model.input_shape == (None, input_size(name), input_size(name), 3)
    assert model.output_shape == (None, 10)


def test_fused_and_stock_batchnorm_models_have_the_same_weights():
    fused = build_model("resnet20", fused_batchnorm=True)
    stock = build_model("resnet20", fused_batchnorm=False)
    assert [w.shape for w in fused.weights] == [w.shape for w in stock.weights]
    assert sum(isinstance(layer, FusedBatchNormalization) for layer in fused.layers) == 19
    assert not any(isinstance(layer, FusedBatchNormalization) for layer in stock.layers)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,fused_batchnorm",
    [("tiny", True), ("tutorial", True), ("resnet8", True), ("resnet8", False), ("resnet20", True), ("fast", True)],
)
def test_forward_train_step_and_keras_round_trip(name, fused_batchnorm, tmp_path):
    keras.utils.set_random_seed(0)
    model = build_model(name, fused_batchnorm=fused_batchnorm)
    images, labels = mock_batch(name)

    logits = model(images, training=False)
    assert logits.shape == (BATCH, 10) and logits.dtype == tf.float32

    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    before = [weight.numpy().copy() for weight in model.trainable_weights]
    loss, accuracy = model.train_on_batch(images, labels)
    assert np.isfinite(loss) and 0.0 <= accuracy <= 1.0
    changed = [not np.array_equal(old, new.numpy()) for old, new in zip(before, model.trainable_weights)]
    assert all(changed), "every trainable weight should receive a gradient"

    # The saved model (with moving statistics that moved during the step) predicts identically.
    path = tmp_path / f"{name}.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    assert restored.count_params() == model.count_params()
    np.testing.assert_array_equal(restored.predict(images, verbose=0), model.predict(images, verbose=0))


def test_fused_batchnorm_is_a_drop_in_replacement_in_resnet():
    keras.utils.set_random_seed(1)
    fused = build_model("resnet8", fused_batchnorm=True)
    stock = build_model("resnet8", fused_batchnorm=False)
    stock.set_weights(fused.get_weights())
    images, _ = mock_batch("resnet8", seed=1)
    for training in (False, True):
        np.testing.assert_allclose(fused(images, training=training), stock(images, training=training), atol=1e-4)


@pytest.mark.parametrize("depth", [20, 32, 44, 56, 110, 8])
def test_resnet_depth_counts_weighted_layers(depth):
    blocks = resnet_depth_blocks(depth)
    assert 6 * blocks + 2 == depth
    if depth > 32:
        return  # Building the deep ones only repeats the arithmetic above.
    model = build_model(f"resnet{depth}")
    convolutions = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    # Depth counts convs and the dense layer; the estimator's shortcuts have no weights ("option A").
    assert len(convolutions) + len(dense) == depth
    assert all(layer.kernel_size == (3, 3) and not layer.use_bias for layer in convolutions)


@pytest.mark.parametrize("name", ["resnet21", "resnet2", "resnet", "resnetx", "vgg16", "Tiny"])
def test_unknown_models_and_bad_depths_are_value_errors(name):
    with pytest.raises(ValueError):
        build_model(name)


def test_bad_normalization_statistics_are_value_errors():
    with pytest.raises(ValueError):
        build_model("tiny", mean=(0.5, 0.5), std=(0.2, 0.2))
    with pytest.raises(ValueError):
        build_model("tiny", std=(0.2, 0.0, 0.2))


def test_resnet_stages_halve_resolution_and_pad_channels():
    model = build_model("resnet20")
    assert model.get_layer("stage1_block3_relu2").output.shape == (None, 32, 32, 16)
    assert model.get_layer("stage2_block1_relu2").output.shape == (None, 16, 16, 32)
    assert model.get_layer("stage3_block3_relu2").output.shape == (None, 8, 8, 64)
    # The shortcut into stage 2 is average-pooled and zero-padded 8 channels on each side.
    pad = model.get_layer("stage2_block1_shortcut_pad")
    assert (pad.before, pad.after) == (8, 8)
    stem = model.get_layer("stem_bn")
    assert (stem.momentum, stem.epsilon) == (0.997, 1e-5)


def test_tutorial_follows_the_tf_tutorial():
    model = build_model("tutorial")
    assert model.get_layer("pool1").output.shape == (None, 12, 12, 64)
    assert model.get_layer("pool2").output.shape == (None, 6, 6, 64)
    assert model.get_layer("flatten").output.shape == (None, 2304)
    norm = model.get_layer("norm1")
    assert (norm.depth_radius, norm.bias, norm.alpha, norm.beta) == (4, 1.0, 0.001 / 9.0, 0.75)
    # Order of the second stage: conv -> LRN -> pool.
    names = [layer.name for layer in model.layers]
    assert names.index("conv2") < names.index("norm2") < names.index("pool2")
    assert np.allclose(model.get_layer("local3").bias.numpy(), 0.1)


def test_fast_logits_are_the_classifier_scaled_by_one_ninth():
    model = build_model("fast")
    images, _ = mock_batch("fast")
    features = keras.Model(model.input, model.get_layer("pool").output)(images)
    classifier = model.get_layer("classifier")
    assert classifier.bias is None
    expected = np.asarray(features) @ classifier.kernel.numpy() / 9.0
    np.testing.assert_allclose(model(images), expected, rtol=1e-4, atol=1e-6)
    assert model.get_layer("group1_bn1").gamma is None  # BN without scale, as airbench.


def test_init_whitening_whitens_patches():
    model = build_model("fast")
    images, _ = mock_batch("fast")
    eigenvalues = init_whitening(model, images)
    assert eigenvalues.shape == (12,) and np.all(np.diff(eigenvalues) <= 0)
    whitening = model.get_layer("whitening")
    assert isinstance(whitening, PatchWhitening)
    whitened = keras.Model(model.input, whitening.output)(images).numpy().reshape(-1, 24)
    positive = whitened[:, :12] - whitening.bias.numpy()[:12]
    np.testing.assert_allclose(positive, -(whitened[:, 12:] - whitening.bias.numpy()[12:]), atol=1e-4)
    # Unit second moments, no correlation (up to the eigenvalue epsilon: lambda / (lambda + eps)).
    second_moments = positive.T @ positive / len(positive)
    np.testing.assert_allclose(second_moments, np.diag(eigenvalues / (eigenvalues + 5e-4)), atol=2e-3)


def test_patch_second_moments_match_explicit_patches():
    images = np.random.default_rng(2).normal(size=(7, 5, 6, 3))
    patches = tf.image.extract_patches(images, [1, 2, 2, 1], [1, 1, 1, 1], [1, 1, 1, 1], "VALID").numpy()
    patches = patches.reshape(-1, 12)  # (7 * 4 * 5, 2 * 2 * 3), ordered (row, column, channel).
    expected = patches.T @ patches / len(patches)
    np.testing.assert_allclose(patch_second_moments(images, 2, chunk_size=3), expected, rtol=1e-10)


def test_init_whitening_rejects_bad_input():
    with pytest.raises(ValueError, match="PatchWhitening"):
        init_whitening(build_model("tiny"), mock_batch("tiny")[0])
    with pytest.raises(ValueError, match="shape"):
        init_whitening(build_model("fast"), np.zeros((4, 32, 32), np.uint8))


@pytest.mark.parametrize("name", ["tutorial", "resnet8", "fast"])
def test_mixed_bfloat16_models_compute_in_bf16_and_return_float32_logits(name, mixed_bfloat16):
    model = build_model(name)
    images, _ = mock_batch(name)
    assert model.get_layer("normalize").compute_dtype == "bfloat16"
    logits = model(images, training=True)
    assert logits.dtype == tf.float32 and np.all(np.isfinite(logits))
