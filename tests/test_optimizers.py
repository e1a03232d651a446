"""Muon on the conv filters (`cifar.optimizers.ConvMuon`): its pieces, one step against NumPy, and its state.

The reference step below is airbench94_muon's, written out in NumPy (float64): Nesterov momentum of
the gradients, the whole kernel rescaled to a Frobenius norm of sqrt(filters), then the quintic
Newton-Schulz iteration on the (H*W*C_in, filters) matrix. Everything that is not a filter takes
Keras's SGD step. The optimizer runs the iteration in bfloat16, hence the tolerances.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from cifar.config import TrainConfig, make_config
from cifar.optimizers import NEWTON_SCHULZ_COEFFICIENTS, ConvMuon, GroupedSGD, orthogonalise, renormalised
from cifar.train import add_weight_decay, make_optimizer


def numpy_orthogonalise(matrix: np.ndarray, steps: int = 3) -> np.ndarray:
    first, second, third = NEWTON_SCHULZ_COEFFICIENTS
    x = matrix / (np.linalg.norm(matrix) + 1e-7)
    transposed = x.shape[0] > x.shape[1]
    x = x.T if transposed else x
    for _ in range(steps):
        gram = x @ x.T
        x = first * x + (second * gram + third * gram @ gram) @ x
    return x.T if transposed else x


@pytest.mark.parametrize("shape", [(216, 64), (64, 216), (576, 256)])
def test_orthogonalise_puts_every_singular_value_near_one(shape):
    matrix = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 30.0
    result = np.asarray(orthogonalise(matrix))
    assert result.shape == shape
    singular_values = np.linalg.svd(result, compute_uv=False)
    # Three steps of the record's polynomial land in ~[0.68, 1.2], whatever the input's scale.
    assert singular_values.min() > 0.6 and singular_values.max() < 1.3
    # And it points where U V^T does (the exact orthogonal factor of the input).
    left, _, right = np.linalg.svd(matrix, full_matrices=False)
    polar = left @ right
    cosine = np.sum(result * polar) / (np.linalg.norm(result) * np.linalg.norm(polar))
    assert cosine > 0.98
    np.testing.assert_allclose(result, numpy_orthogonalise(matrix.astype(np.float64)), atol=0.03)


def test_orthogonalise_keeps_a_zero_direction_at_zero():
    assert np.all(np.asarray(orthogonalise(np.zeros((18, 4), np.float32))) == 0.0)


def test_renormalised_gives_unit_rms_filters_and_keeps_their_proportions():
    kernel = np.random.default_rng(1).standard_normal((3, 3, 8, 16)).astype(np.float32) * 7.0
    result = np.asarray(renormalised(kernel))
    assert np.linalg.norm(result) == pytest.approx(4.0, rel=1e-5)  # sqrt(16 filters).
    np.testing.assert_allclose(result / kernel, np.full_like(kernel, result.flat[0] / kernel.flat[0]), rtol=1e-5)


def tiny_conv_net() -> keras.Model:
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(4, 3, use_bias=False, name="conv")(inputs)  # kernel (3, 3, 2, 4)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="dense")(x))


def gradients_of(model: keras.Model, seed: int) -> list[tf.Tensor]:
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((8, 6, 6, 2)).astype(np.float32)
    labels = rng.integers(0, 3, 8)
    with tf.GradientTape() as tape:
        loss = keras.losses.sparse_categorical_crossentropy(labels, model(images), from_logits=True)
        loss = tf.reduce_mean(loss)
    return tape.gradient(loss, model.trainable_variables)


def test_conv_muon_step_matches_a_numpy_reference_on_a_tiny_conv_net():
    keras.utils.set_random_seed(0)
    model = tiny_conv_net()
    learning_rate, momentum, muon_multiplier, muon_momentum = 0.05, 0.85, 4.0, 0.6
    optimizer = ConvMuon(
        learning_rate,
        momentum=momentum,
        nesterov=True,
        muon_learning_rate_multiplier=muon_multiplier,
        muon_momentum=muon_momentum,
    )
    names = [variable.path for variable in model.trainable_variables]
    assert names == ["conv/kernel", "dense/kernel", "dense/bias"]
    expected = [np.asarray(variable, np.float64) for variable in model.trainable_variables]
    buffers = [np.zeros_like(value) for value in expected]
    for step in range(3):  # Three steps: the momentum buffers take part.
        gradients = gradients_of(model, step)
        optimizer.apply(gradients, model.trainable_variables)
        for index, gradient in enumerate(np.asarray(g, np.float64) for g in gradients):
            if index == 0:  # The conv kernel: Muon, PyTorch's buffer convention.
                buffers[0] = muon_momentum * buffers[0] + gradient
                direction = gradient + muon_momentum * buffers[0]
                kernel = expected[0] * (2.0 / np.linalg.norm(expected[0]))  # sqrt(4 filters).
                update = numpy_orthogonalise(direction.reshape(-1, 4)).reshape(kernel.shape)
                expected[0] = kernel - learning_rate * muon_multiplier * update
            else:  # Everything else: Keras's Nesterov SGD.
                buffers[index] = momentum * buffers[index] - learning_rate * gradient
                expected[index] = expected[index] + momentum * buffers[index] - learning_rate * gradient
            # Start the next step from the optimizer's own weights, so bfloat16 errors do not add up.
        actual = [np.asarray(variable, np.float64) for variable in model.trainable_variables]
        np.testing.assert_allclose(actual[0], expected[0], atol=learning_rate * muon_multiplier * 0.03)
        for mine, reference in zip(actual[1:], expected[1:]):
            np.testing.assert_allclose(mine, reference, rtol=1e-5, atol=1e-7)
        expected = actual
    np.testing.assert_allclose(np.asarray(optimizer.momentums[0]), buffers[0], rtol=1e-5, atol=1e-7)


def test_conv_muon_without_sgd_momentum_still_keeps_the_filters_momentum():
    model = tiny_conv_net()
    optimizer = ConvMuon(0.1, momentum=0.0, muon_momentum=0.5)
    gradients = gradients_of(model, 0)
    optimizer.apply(gradients, model.trainable_variables)
    np.testing.assert_allclose(np.asarray(optimizer.momentums[0]), np.asarray(gradients[0]), rtol=1e-6)
    with pytest.raises(ValueError, match="muon_momentum"):
        ConvMuon(0.1, muon_momentum=1.0)
    with pytest.raises(ValueError, match="muon_learning_rate_multiplier"):
        ConvMuon(0.1, muon_learning_rate_multiplier=0.0)


def compiled_tiny_net(optimizer: keras.optimizers.Optimizer) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = tiny_conv_net()
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.slow
def test_conv_muon_state_round_trips_a_checkpoint_and_resumes_the_same_steps(tmp_path):
    rng = np.random.default_rng(0)
    images, labels = rng.standard_normal((32, 6, 6, 2)).astype(np.float32), rng.integers(0, 3, 32)

    def fresh_optimizer():
        schedule = keras.optimizers.schedules.PolynomialDecay(0.1, 8, end_learning_rate=0.0)
        return ConvMuon(schedule, momentum=0.85, nesterov=True, muon_learning_rate_multiplier=2.0, muon_momentum=0.6)

    straight = compiled_tiny_net(fresh_optimizer())
    straight.fit(images, labels, batch_size=8, epochs=2, shuffle=False, verbose=0)  # 8 steps in one go.

    first = compiled_tiny_net(fresh_optimizer())
    first.fit(images, labels, batch_size=8, epochs=1, shuffle=False, verbose=0)
    first.save(tmp_path / "epoch-0001.keras")
    # As cifar.train resumes: the same model and optimizer built anew, then the checkpoint loaded.
    resumed = compiled_tiny_net(fresh_optimizer())
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(tmp_path / "epoch-0001.keras")
    assert int(resumed.optimizer.iterations) == 4
    for saved, loaded in zip(first.optimizer.variables, resumed.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(loaded))
    resumed.fit(images, labels, batch_size=8, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    for mine, reference in zip(resumed.trainable_variables, straight.trainable_variables):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(reference), rtol=1e-5, atol=1e-6)

    restored = keras.models.load_model(tmp_path / "epoch-0001.keras")  # The config round-trips too.
    assert isinstance(restored.optimizer, ConvMuon)
    assert restored.optimizer.muon_learning_rate_multiplier == 2.0 and restored.optimizer.muon_momentum == 0.6


def test_muon_config_trains_filters_with_muon_and_leaves_them_undecayed():
    config = make_config("fast-sgd", {"train": {"optimizer": "muon", "muon_learning_rate": 0.3, "batch_size": 512}})
    optimizer = make_optimizer(config, steps_per_epoch=97)
    assert isinstance(optimizer, ConvMuon)
    peak = config.train.learning_rate * 512 / 128
    assert optimizer.muon_learning_rate_multiplier * peak == pytest.approx(0.3)  # The filters' peak step.
    assert type(make_optimizer(make_config("fast-sgd"), steps_per_epoch=48)) is GroupedSGD

    model = tiny_conv_net()
    decayed = add_weight_decay(model, 1e-3, decay_biases=True, decay_filters=False)
    assert decayed == ["dense/kernel", "dense/bias"]


def test_muon_settings_under_sgd_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="muon_momentum .* applies to optimizer 'muon' only"):
        TrainConfig(muon_momentum=0.7)
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="adam")
    assert TrainConfig(optimizer="muon", muon_momentum=0.7).muon_momentum == 0.7
