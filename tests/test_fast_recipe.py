"""The pieces of the airbench94 recipe behind the `fast-sgd` and `fast` presets, each checked on its own.

Parameter groups of the optimizer, the one-cycle schedule's end points, lookahead, decay of
biases, alternating flips with reflect-padded translation, and flip + translate test-time
augmentation; then the preset itself trains the fast net end to end on the fixture data.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from cifar import schedules
from cifar.callbacks import Lookahead
from cifar.config import DataConfig, TrainConfig, make_config
from cifar.data.prepare import prepare_data
from cifar.evaluate import translated, tta_logits
from cifar.input_pipeline import alternating_flips, color_jitter, make_train_dataset, random_crop_flip
from cifar.optimizers import GroupedSGD
from cifar.train import add_weight_decay, make_optimizer, train


@pytest.fixture(scope="module")
def data_dir(python_archive, tmp_path_factory) -> str:
    config = DataConfig(source=python_archive, expect_official_counts=False, validation_size=0)
    return prepare_data(config, tmp_path_factory.mktemp("fast-data")).data_dir


def _variables():
    weight = keras.Variable(np.ones(3, np.float32), name="kernel")
    beta = keras.Variable(np.ones(3, np.float32), name="beta")
    return weight, beta


def _steps(optimizer, variables, gradients, count):
    for _ in range(count):
        optimizer.apply(gradients, variables)
    return [np.asarray(variable) for variable in variables]


def test_grouped_sgd_without_groups_is_keras_sgd():
    gradients = [tf.constant([0.5, -1.0, 2.0]), tf.constant([1.0, 1.0, -1.0])]
    ours = _steps(GroupedSGD(0.1, momentum=0.85, nesterov=True), _variables(), gradients, 4)
    keras_sgd = _steps(keras.optimizers.SGD(0.1, momentum=0.85, nesterov=True), _variables(), gradients, 4)
    for mine, theirs in zip(ours, keras_sgd):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6)


def test_grouped_sgd_multiplies_the_rate_of_matching_variables():
    gradients = [tf.constant([1.0, 1.0, 1.0])] * 2
    optimizer = GroupedSGD(0.01, momentum=0.9, nesterov=True, learning_rate_multipliers={r"beta$": 64.0})
    weight, beta = _steps(optimizer, _variables(), gradients, 3)
    # Momentum is linear in the rate, so the matching variable moves exactly 64x as far.
    np.testing.assert_allclose(1.0 - beta, 64.0 * (1.0 - weight), rtol=1e-5)


def test_grouped_sgd_stops_a_group_dead_after_its_last_step():
    gradients = [tf.constant([1.0, 1.0, 1.0])] * 2
    optimizer = GroupedSGD(0.1, momentum=0.9, stop_after_steps={r"beta$": 2})
    variables = _variables()
    _, beta_after_two = _steps(optimizer, variables, gradients, 2)
    weight_after_two = np.asarray(variables[0]).copy()
    weight, beta = _steps(optimizer, variables, gradients, 3)
    assert (beta_after_two < 1.0).all()
    np.testing.assert_array_equal(beta, beta_after_two)  # Not even momentum moves it on.
    assert (weight < weight_after_two).all()  # The others keep training.
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(optimizer))
    assert restored.stop_after_steps == {r"beta$": 2}


def test_onecycle_starts_and_ends_at_fractions_of_the_peak():
    train = TrainConfig(
        schedule="onecycle",
        learning_rate=0.1875,
        batch_size=1024,
        epochs=10,
        warmup_epochs=2.3,
        warmup_initial_factor=0.2,
        final_learning_rate_factor=0.07,
    )
    schedule = schedules.make_schedule(train, steps_per_epoch=48)
    peak = 1.5  # 0.1875 * 1024 / 128.
    warmup_steps = round(2.3 * 48)
    assert float(schedule(0)) == pytest.approx(peak * (0.2 + 0.8 / warmup_steps), rel=1e-5)
    assert float(schedule(warmup_steps)) == pytest.approx(peak, rel=1e-5)
    assert float(schedule(480)) == pytest.approx(0.07 * peak, rel=1e-5)
    values = [float(schedule(step)) for step in range(481)]
    assert max(values) == pytest.approx(peak, rel=1e-5) and min(values) == pytest.approx(0.07 * peak, rel=1e-5)


def test_decaying_biases_keeps_rate_times_decay_equal_for_every_parameter():
    model = keras.Sequential(
        [keras.Input((4, 4, 3)), keras.layers.Conv2D(2, 3, use_bias=True), keras.layers.BatchNormalization(scale=False)]
    )
    decayed = add_weight_decay(model, 1e-3, decay_biases=True, bias_multiplier=64.0)
    assert len(decayed) == 3  # Kernel, conv bias, batch-norm beta.
    coefficients = {variable.path.split("/")[-1]: variable.regularizer.l2 for variable in model.trainable_variables}
    assert coefficients["kernel"] == pytest.approx(5e-4) and coefficients["bias"] == pytest.approx(5e-4)
    assert coefficients["beta"] == pytest.approx(5e-4 / 64)
    dense = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="dense")])
    decayed = add_weight_decay(dense, 1e-3)  # Without decay_biases, kernels only.
    assert len(decayed) == 1 and decayed[0].endswith("dense/kernel")


def test_the_whitening_bias_can_train_at_its_own_rate_with_decay_to_match():
    inputs = keras.Input((4, 4, 3))
    whitened = keras.layers.Conv2D(2, 2, name="whitening")(inputs)  # Its bias's path is "whitening/bias".
    model = keras.Model(inputs, keras.layers.BatchNormalization(scale=False, name="bn")(whitened))
    add_weight_decay(model, 1e-3, decay_biases=True, bias_multiplier=64.0, whitening_bias_multiplier=16.0)
    coefficients = {variable.path: variable.regularizer.l2 for variable in model.trainable_variables}
    assert coefficients["whitening/bias"] == pytest.approx(5e-4 / 16) and coefficients["bn/beta"] == pytest.approx(
        5e-4 / 64
    )
    config = make_config("fast-sgd", {"train": {"whitening_bias_learning_rate_multiplier": 16.0}})
    optimizer = make_optimizer(config, steps_per_epoch=48)
    assert sorted(optimizer.learning_rate_multipliers.values()) == [16.0, 64.0]
    assert make_optimizer(make_config("fast-sgd"), steps_per_epoch=48).learning_rate_multipliers == {
        r"(^|/)beta$": 64.0
    }


def test_lookahead_blends_on_its_schedule_and_ends_on_the_slow_weights():
    lookahead = Lookahead(every=5, steps_per_epoch=10, total_steps=100)
    assert lookahead.decay_at(0) == 0.0 and lookahead.decay_at(25) == 0.0  # Starts at 30% of the run.
    assert lookahead.decay_at(50) == pytest.approx(0.95**5 * 0.125)
    assert lookahead.decay_at(100) == pytest.approx(0.95**5)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    inputs, targets = np.random.rand(24, 4).astype("float32"), np.random.rand(24, 3).astype("float32")
    history: list[np.ndarray] = []
    recorder = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda *_, **__: history.append(np.asarray(model.weights[0]).copy())
    )
    lookahead = Lookahead(every=2, steps_per_epoch=3, total_steps=6, start_fraction=0.0)
    model.fit(inputs, targets, batch_size=4, epochs=2, steps_per_epoch=3, callbacks=[lookahead, recorder], verbose=0)
    assert int(model.optimizer.iterations) == 6 and len(history) == 6
    # After the last step the weights are the slow copy; a plain SGD run ends elsewhere.
    np.testing.assert_allclose(history[-1], np.asarray(lookahead._slow[0]), rtol=1e-6)
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    plain.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    plain.fit(inputs, targets, batch_size=4, epochs=2, steps_per_epoch=3, verbose=0)
    assert not np.allclose(np.asarray(plain.weights[0]), history[-1])


def test_alternating_flips_mirror_each_image_in_every_other_epoch():
    records = tf.constant([f"record-{index}".encode() for index in range(64)])
    even, odd = (alternating_flips(records, seed=3, epoch=tf.constant(epoch, tf.int64)).numpy() for epoch in (0, 1))
    np.testing.assert_array_equal(even + odd, np.ones(64))  # Each image flipped in exactly one of two epochs.
    assert 16 < even.sum() < 48  # A random half, not all or none.
    np.testing.assert_array_equal(alternating_flips(records, 3, tf.constant(2, tf.int64)).numpy(), even)
    assert not np.array_equal(alternating_flips(records, 4, tf.constant(0, tf.int64)).numpy(), even)


def test_reflect_padded_crops_never_show_zero_borders():
    images = tf.fill([16, 8, 8, 3], tf.constant(200, tf.uint8))
    zeros = random_crop_flip(images, 8, 2, tf.constant([5, 6], tf.int64)).numpy()
    reflect = random_crop_flip(images, 8, 2, tf.constant([5, 6], tf.int64), padding_mode="reflect").numpy()
    assert (zeros == 0).any()  # Some crop was shifted into the zero padding...
    assert (reflect == 200).all()  # ...which reflection fills with image pixels.
    with pytest.raises(ValueError, match="padding_mode"):
        random_crop_flip(images, 8, 2, tf.constant([5, 6], tf.int64), padding_mode="wrap")


def test_color_jitter_shifts_and_stretches_each_image_about_the_channel_means():
    images = tf.constant(np.random.default_rng(0).integers(80, 176, (64, 4, 4, 3)), tf.uint8)
    pixels = images.numpy().astype(np.float64)
    statistics = {"mean": [0.5, 0.45, 0.4], "std": [0.25, 0.24, 0.26]}
    centre, spread = 255 * np.array(statistics["mean"]), 255 * np.array(statistics["std"])
    seed = tf.constant([1, 2], tf.int64)
    unchanged = color_jitter(images, seed, **statistics, brightness=0.0, contrast=0.0)
    np.testing.assert_array_equal(unchanged.numpy(), images.numpy())

    # Brightness: one shift per image, in standard deviations of each channel, within the range.
    shifted = color_jitter(images, seed, **statistics, brightness=0.2, contrast=0.0).numpy()
    shifts = (shifted - pixels) / spread  # (B, H, W, C), normalised units.
    per_image = shifts.mean(axis=(1, 2, 3))
    assert np.abs(shifts - per_image[:, None, None, None]).max() < 0.02  # Rounding to whole pixel levels.
    assert np.abs(per_image).max() <= 0.2 + 0.01 and per_image.std() > 0.05  # Each image its own draw.

    # Contrast: one factor per image, stretching away from (or toward) the channel means.
    stretched = color_jitter(images, seed, **statistics, brightness=0.0, contrast=0.13).numpy()
    away = np.abs(pixels - centre) > 20
    factors = (stretched - centre)[away] / (pixels - centre)[away]
    assert factors.min() > 0.85 and factors.max() < 1.15 and factors.std() > 0.02
    again = color_jitter(images, seed, **statistics, brightness=0.2, contrast=0.13).numpy()
    np.testing.assert_array_equal(again, color_jitter(images, seed, **statistics, brightness=0.2, contrast=0.13))


def test_alternating_flip_pipeline_shows_each_image_both_ways_in_two_epochs(data_dir):
    # Without translation, an image's two epochs are exactly it and its mirror.
    settings = dict(
        splits=["train"],
        batch_size=100,
        image_size=32,
        seed=1,
        deterministic=True,
        crop_padding=0,
        flip="alternating",
        steps_per_epoch=5,
        shuffle_buffer=1,
    )
    batches = [images.numpy() for images, _ in make_train_dataset(data_dir, **settings).take(10)]
    first, second = np.concatenate(batches[:5]), np.concatenate(batches[5:])
    mirrored = first[:, :, ::-1, :]
    same = np.all(first == second, axis=(1, 2, 3))
    flipped = np.all(mirrored == second, axis=(1, 2, 3))
    symmetric = np.all(first == mirrored, axis=(1, 2, 3))
    assert np.all(flipped | symmetric) and not np.any(same & ~symmetric)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        make_train_dataset(data_dir, **{**settings, "steps_per_epoch": None})


def test_translate_tta_shifts_by_one_pixel_with_reflection():
    images = np.arange(2 * 4 * 4 * 1, dtype=np.uint8).reshape(2, 4, 4, 1)
    down_right = translated(images, 1, 1)
    np.testing.assert_array_equal(down_right[:, 1:, 1:], images[:, :-1, :-1])
    np.testing.assert_array_equal(down_right[:, 0, 1:], images[:, 1, :-1])  # Reflected row, not zeros.
    up_left = translated(images, -1, -1)
    np.testing.assert_array_equal(up_left[:, :-1, :-1], images[:, 1:, 1:])

    # A model that ignores pixel positions gives the same logits under every view.
    inputs = keras.Input((4, 4, 1))
    pooled = keras.layers.GlobalAveragePooling2D()(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10, kernel_initializer="ones")(pooled))
    plain = model.predict(images.astype("float32"), verbose=0)
    constant_images = np.full((2, 4, 4, 1), 7, np.uint8)
    np.testing.assert_allclose(
        tta_logits(model, constant_images, 2), model.predict(constant_images.astype("float32"), verbose=0), rtol=1e-5
    )
    assert tta_logits(model, images, 2).shape == plain.shape


def test_fast_sgd_preset_config_is_airbench94_converted():
    train_config = make_config("fast-sgd").train
    assert train_config.batch_size == 1024 and train_config.momentum == 0.85
    assert train_config.learning_rate * train_config.batch_size / 128 == pytest.approx(1.5)
    assert train_config.lookahead_steps == 5 and train_config.ema_decay is None
    with pytest.raises(ValueError, match="at most one"):
        make_config("fast-sgd", {"train": {"ema_decay": 0.99}})
    optimizer = make_optimizer(make_config("fast-sgd"), steps_per_epoch=48)
    assert type(optimizer) is GroupedSGD
    assert optimizer.learning_rate_multipliers and list(optimizer.stop_after_steps.values()) == [144]


def test_fast_and_sprint_are_the_sgd_recipes_with_muon_on_the_filters_in_fewer_steps():
    for name in ("fast", "sprint"):
        muon, sgd = make_config(name).train, make_config(f"{name}-sgd").train
        assert (muon.optimizer, sgd.optimizer) == ("muon", "sgd")
        changed = {field for field in type(muon).model_fields if getattr(muon, field) != getattr(sgd, field)}
        shortened = {"epochs", "batch_size", "warmup_epochs", "steps_per_epoch"}
        assert changed <= {"optimizer", "muon_learning_rate", *shortened}
        assert make_config(name).data == make_config(f"{name}-sgd").data
        assert make_config(name).evaluate == make_config(f"{name}-sgd").evaluate
    fast, fast_sgd = make_config("fast").train, make_config("fast-sgd").train
    assert fast.epochs < fast_sgd.epochs and fast.warmup_epochs / fast.epochs == pytest.approx(0.23)
    sprint, sprint_sgd = make_config("sprint").train, make_config("sprint-sgd").train
    assert sprint.steps_per_epoch < 50_000 // sprint_sgd.batch_size  # Shorter epochs: fewer images seen.


@pytest.mark.slow
def test_fast_preset_trains_the_fast_net_end_to_end(data_dir, tmp_path):
    overrides = {
        "train": {
            "epochs": 2,
            "batch_size": 100,
            "warmup_epochs": 1,
            "whitening_bias_epochs": 1,
            "deterministic": True,
            "shuffle_buffer": 1000,
            # The recipe, not the kernel choice (tests/test_kernel_choice.py): no timing of three variants.
            "fused_batchnorm": True,
            "fused_gelu": True,
        },
        "tracking": {"system_metrics": False},
    }
    config = make_config("fast", overrides)
    result = train(config, data_dir, tmp_path)
    assert result.epochs_completed == 2 and np.isfinite(result.metrics["loss"])
    assert result.metrics["accuracy"] > 0.1  # 1,000 fixture images of noise-like classes: above chance.
