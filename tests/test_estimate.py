"""The training estimate said before training (cifar.estimate): which speed it trusts, when it times, what it
remembers, the faster preset it names, and the time left on the progress bar."""

from __future__ import annotations

import keras
import pytest

from cifar import estimate as estimates
from cifar.callbacks import EpochProgress
from cifar.config import make_config
from cifar.estimate import SpeedMemory, TrainingEstimate, estimate_training, faster_preset_hint, speed_key
from cifar.text import duration


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CIFAR_CACHE_DIR", str(tmp_path / "cache"))


def never_timed(train, precisions):
    raise AssertionError("timed a training the estimate should not time")


def test_a_remembered_speed_is_trusted_first():
    config = make_config("fast")
    key = speed_key(config.train, "mixed_bfloat16", 1)
    estimates.remember_speed(key, 500.0, "fast-run-1")
    timing = {"precision": "mixed_bfloat16", "precision_mixed_bfloat16_images_per_second": "900.0"}
    estimate = estimate_training(config, timing, 48, 12, 1, time_steps=never_timed)
    images = 12 * 48 * config.train.batch_size
    assert estimate.images == images and estimate.images_per_second == 500.0
    assert estimate.seconds == pytest.approx(images / 500)
    assert estimate.source.startswith("remembered: this pipeline trained fast in mixed_bfloat16")
    assert "fast-run-1" in estimate.source
    assert estimate.describe().startswith(
        f"Training estimate: about {images / 500 / 60:.0f} min for 12 epochs of {images:,}"
    )
    # Another precision, batch or replica count is another speed: not remembered.
    assert speed_key(config.train, "float32", 1) != key and speed_key(config.train, "mixed_bfloat16", 2) != key


def test_else_the_precision_choices_timing_scaled_to_the_pipeline():
    config = make_config("fast")
    timing = {"precision": "mixed_bfloat16", "precision_mixed_bfloat16_images_per_second": "1000.0"}
    estimate = estimate_training(config, timing, 48, 12, 1, time_steps=never_timed)
    assert estimate.images_per_second == pytest.approx(1000.0 * estimates.PIPELINE_SHARE)
    assert estimate.source.startswith("timed: 1,000 images/s for fast alone in mixed_bfloat16 at batch 128")
    assert estimate.tags()["estimate.minutes"] == f"{estimate.seconds / 60:.1f}"


def test_without_a_timing_a_long_training_is_timed_and_the_precision_policy_kept():
    config = make_config("fast", {"train": {"precision": "float32"}})
    calls = []

    def time_steps(train, precisions):
        calls.append(precisions)
        keras.mixed_precision.set_global_policy("float32")  # What the real timing leaves behind.
        return {precision: 200.0 for precision in precisions}

    keras.mixed_precision.set_global_policy("mixed_bfloat16")  # As configure_performance left it.
    try:
        estimate = estimate_training(config, {"precision": "mixed_bfloat16"}, 48, 12, 1, time_steps=time_steps)
        assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert calls == [("mixed_bfloat16",)] and estimate.images_per_second == pytest.approx(
        200.0 * estimates.PIPELINE_SHARE
    )


def test_a_short_training_or_a_workers_job_is_not_timed():
    config = make_config("smoke")
    short = estimate_training(config, {"precision": "float32"}, 60, 2, 1, time_steps=never_timed)
    assert short.seconds is None and "not timed: shorter than 50,000 images" in short.describe()
    long = make_config("fast")
    job = estimate_training(long, {"precision": "float32"}, 48, 12, 2, num_workers=2, time_steps=never_timed)
    assert job.seconds is None and "a multi-worker job" in job.source


def test_a_faster_preset_within_two_points_is_named_and_nothing_is_switched():
    hint = faster_preset_hint(make_config("full"))
    assert (
        hint.startswith("The `fast` preset reached 92.0 % test accuracy (`full`: 89.9 %)") and "--preset fast" in hint
    )
    assert "`sprint` preset" in faster_preset_hint(make_config("default"))
    assert faster_preset_hint(make_config("fast")) is None  # sprint is 4.5 points below.
    assert faster_preset_hint(make_config("full", {"train": {"epochs": 10}})) is None  # Not the preset as measured.
    estimate = estimate_training(make_config("full"), {"precision": "float32"}, 390, 1, 1, time_steps=never_timed)
    assert estimate.describe().endswith("--preset fast to use it")


def test_a_long_estimate_names_the_preset_for_a_coffee_break():
    config = make_config("fast")  # On a CPU without bfloat16 math: ~100 images/s, about 1.5 hours.
    steps = 50_000 // config.train.batch_size
    estimates.remember_speed(speed_key(config.train, "float32", 1), 100.0, "fast-avx2")
    estimate = estimate_training(config, {"precision": "float32"}, steps, 12, 1, time_steps=never_timed)
    sprint = estimate.seconds * estimates.PRESET_RESULTS["sprint"][1] / estimates.PRESET_RESULTS["fast"][1]
    assert estimate.coffee_break == (
        f"For a coffee break: `--preset sprint` (87.5 % test accuracy) would take {duration(sprint)} here"
    )
    assert estimate.describe().endswith(estimate.coffee_break)
    estimates.remember_speed(speed_key(config.train, "float32", 1), 1000.0, "fast-bf16")  # 10 minutes: no break.
    assert estimate_training(config, {"precision": "float32"}, steps, 12, 1).coffee_break is None


def test_the_speed_is_remembered_from_whole_epochs_after_the_first():
    config = make_config("smoke")
    estimate = TrainingEstimate(epochs=3, images=3 * 7_680, images_per_second=None, source="", key="k")
    memory = SpeedMemory(estimate, "smoke-run")
    for seconds in (10.0, 2.0, 2.4):  # The first epoch traces: left out once later ones exist.
        memory.on_epoch_end(0, {"epoch_seconds": seconds})
    assert estimates.remembered_speed("k")["images_per_second"] == pytest.approx(7_680 / 2.2, abs=0.1)
    assert estimates.remembered_speed("other") is None
    assert config.train.epochs == 2


def test_an_unreadable_speed_file_is_ignored():
    estimates.speed_path().parent.mkdir(parents=True)
    estimates.speed_path().write_text("{not json")
    assert estimates.remembered_speed("k") is None
    estimates.remember_speed("k", 10.0, "run")  # And written again.
    assert estimates.remembered_speed("k")["images_per_second"] == 10.0
    estimates.speed_path().write_text('{"k": {"images_per_second": "fast"}, "j": {"images_per_second": -1}}')
    assert estimates.remembered_speed("k") is None and estimates.remembered_speed("j") is None


def test_the_progress_bar_gets_the_time_left():
    reports = []
    progress = EpochProgress(reports.append, epochs=4)
    for epoch, seconds in enumerate((30.0, 10.0, 12.0, 11.0)):
        progress.on_epoch_end(epoch, {"loss": 1.0, "epoch_seconds": seconds})
    assert [report["seconds_left"] for report in reports] == [90.0, 20.0, 11.0, 0.0]
    assert [duration(value) for value in (40, 960, 8280)] == ["about 40 s", "about 16 min", "about 2.3 h"]
