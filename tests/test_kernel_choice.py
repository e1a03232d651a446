"""Fused kernels or Keras's layers for batch norm and GELU (`fused_batchnorm` / `fused_gelu: auto`): the faster as
timed (given timings here, as for the precision choice), remembered; never timed where it cannot matter or must
not differ; a resumed run builds what its checkpoint holds; the estimate follows the variant chosen."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

from cifar import performance
from cifar.checkpoints import saved_kernels
from cifar.config import TrainConfig, make_config
from cifar.estimate import PIPELINE_SHARE, estimate_training
from cifar.io import CACHE_DIR_ENV
from cifar.models import build_model


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))


class Timings:
    """A fake timing of the kernel variants that records what it was asked."""

    def __init__(self, **speeds: float) -> None:
        self.speeds, self.calls = speeds, []

    def __call__(self, train: TrainConfig, precision: str, layers: list[str]) -> dict[str, float]:
        self.calls.append((train.model, precision, tuple(layers)))
        names = {"fused", *(performance.KERAS_VARIANTS[layer] for layer in layers)}
        return {name: speed for name, speed in self.speeds.items() if name in names}


@pytest.mark.parametrize(
    "speeds,expected",
    [
        # Issue 49's Zen 3, the fast net in float32: fused 103 images/s, Keras's 108 (1.05x): Keras's batch norm.
        ({"fused": 103.0, "keras_batchnorm": 108.2, "keras_gelu": 101.0}, (False, True)),
        ({"fused": 100.0, "keras_batchnorm": 90.0, "keras_gelu": 110.0}, (True, False)),
        ({"fused": 100.0, "keras_batchnorm": 104.0, "keras_gelu": 99.0}, (True, True)),  # Within the noise: fused.
    ],
)
def test_auto_picks_the_faster_kernels_as_timed(speeds, expected):
    timings = Timings(**speeds)
    choice = performance.resolve_kernels(TrainConfig(model="fast"), "float32", 0, measure=timings)
    assert (choice.fused_batchnorm, choice.fused_gelu) == expected
    assert (choice.reason, timings.calls) == ("measured", [("fast", "float32", ("batchnorm", "gelu"))])
    settings = choice.settings()
    assert settings["fused_batchnorm"] == str(expected[0]).lower() and settings["kernels_reason"] == "measured"
    assert settings["kernels_images_per_second"] == f"{speeds[choice.variant]:.1f}"  # What the estimate takes.


def test_a_timing_is_remembered_per_model_precision_and_layers_asked():
    timings = Timings(fused=103.0, keras_batchnorm=110.0, keras_gelu=100.0)
    for _ in range(2):
        choice = performance.resolve_kernels(TrainConfig(model="resnet56"), "float32", 0, measure=timings)
        assert (choice.fused_batchnorm, choice.fused_gelu) == (False, True)  # The ResNet has no GELU.
    assert (len(timings.calls), choice.reason) == (1, "remembered")
    performance.resolve_kernels(TrainConfig(model="resnet56"), "mixed_bfloat16", 0, measure=timings)
    performance.resolve_kernels(TrainConfig(model="fast", fused_gelu=True), "float32", 0, measure=timings)
    assert timings.calls[1:] == [("resnet56", "mixed_bfloat16", ("batchnorm",)), ("fast", "float32", ("batchnorm",))]
    cache = json.loads(performance.precision_cache_path().read_text())
    assert {"fused": 103.0, "keras_batchnorm": 110.0} in [entry["images_per_second"] for entry in cache.values()]


def test_a_remembered_timing_without_every_variant_is_timed_again():
    train = TrainConfig(model="fast")
    timings = Timings(fused=100.0, keras_batchnorm=120.0, keras_gelu=90.0)
    performance.resolve_kernels(train, "float32", 0, measure=timings)
    path = performance.precision_cache_path()
    cache = json.loads(path.read_text())
    for entry in cache.values():  # Damaged: a variant lost, another not a number.
        entry["images_per_second"].pop("keras_gelu")
        entry["images_per_second"]["fused"] = "fast"
    path.write_text(json.dumps(cache))
    choice = performance.resolve_kernels(train, "float32", 0, measure=timings)
    assert (choice.reason, len(timings.calls), choice.fused_batchnorm) == ("measured", 2, False)


@pytest.mark.parametrize(
    "train,num_gpus,num_workers,saved,expected",
    [
        (TrainConfig(model="tutorial"), 0, 1, None, (True, True, "not in tutorial")),  # Neither layer: no choice.
        (TrainConfig(model="fast", fused_batchnorm=False, fused_gelu=True), 0, 1, None, (False, True, "configured")),
        (TrainConfig(model="fast"), 1, 1, None, (True, True, "gpu")),
        (TrainConfig(model="fast"), 0, 2, None, (True, True, "multi-worker")),  # Every worker the same model.
        (TrainConfig(model="fast"), 0, 1, {"batchnorm": False, "gelu": True}, (False, True, "checkpoint")),
        # A configured value stays what it is; only "auto" follows the checkpoint.
        (
            TrainConfig(model="fast", fused_gelu=False),
            0,
            1,
            {"batchnorm": False, "gelu": True},
            (False, False, "checkpoint"),
        ),
    ],
)
def test_nothing_is_timed_where_it_cannot_matter_or_must_not_differ(train, num_gpus, num_workers, saved, expected):
    timings = Timings(fused=1.0, keras_batchnorm=9.0, keras_gelu=9.0)
    choice = performance.resolve_kernels(train, "float32", num_gpus, num_workers=num_workers, saved=saved,
                                         measure=timings)  # fmt: skip
    assert (choice.fused_batchnorm, choice.fused_gelu, choice.reason) == expected
    assert timings.calls == [] and "kernels_images_per_second" not in choice.settings()


def test_the_run_is_configured_with_the_kernels_chosen(monkeypatch):
    timings = Timings(fused=100.0, keras_batchnorm=120.0, keras_gelu=90.0)
    monkeypatch.setattr(performance, "measure_kernel_variants", timings)
    settings = performance.configure_performance(TrainConfig(model="fast", precision="float32"), 0)
    assert (settings["fused_batchnorm"], settings["fused_gelu"], settings["kernels_reason"]) == ("false", "true",
                                                                                                "measured")  # fmt: skip
    assert settings["kernels_keras_batchnorm_images_per_second"] == "120.0"


def test_the_variants_timed_are_fused_and_one_keras_layer_each(monkeypatch):
    asked = []
    monkeypatch.setattr(performance, "_time_variants", lambda train, variants: asked.append(variants) or {})
    performance.measure_kernel_variants(TrainConfig(model="fast"), "mixed_bfloat16", ["batchnorm", "gelu"])
    performance.measure_kernel_variants(TrainConfig(model="fast", fused_gelu=False), "float32", ["batchnorm"])
    assert asked == [
        {"fused": ("mixed_bfloat16", True, True), "keras_batchnorm": ("mixed_bfloat16", False, True),
         "keras_gelu": ("mixed_bfloat16", True, False)},
        {"fused": ("float32", True, False), "keras_batchnorm": ("float32", False, False)},
    ]  # fmt: skip


@pytest.mark.parametrize(
    "name,fused_batchnorm,fused_gelu,expected",
    [
        ("fast", False, False, {"batchnorm": False, "gelu": False}),
        ("fast", True, True, {"batchnorm": True, "gelu": True}),
        ("resnet8", False, True, {"batchnorm": False}),
        ("tutorial", True, True, {}),
    ],
)
def test_a_checkpoint_says_which_kernels_it_was_built_with(tmp_path, name, fused_batchnorm, fused_gelu, expected):
    path = tmp_path / "epoch-0001.keras"
    build_model(name, fused_batchnorm=fused_batchnorm, fused_gelu=fused_gelu).save(path)
    assert saved_kernels(path) == expected


def test_a_checkpoint_resumes_only_into_the_batch_norm_it_holds(tmp_path):
    """Why a resumed run builds its checkpoint's kinds: the other kind does not load (Keras: weights by class)."""
    saved = build_model("resnet8", fused_batchnorm=False)
    saved.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy")
    saved.train_on_batch(np.zeros((4, 32, 32, 3), np.uint8), np.zeros(4, np.int32))
    path = tmp_path / "epoch-0001.keras"
    saved.save(path)
    same = build_model("resnet8", fused_batchnorm=saved_kernels(path)["batchnorm"])
    same.load_weights(path)
    assert all(np.array_equal(a, b) for a, b in zip(saved.get_weights(), same.get_weights(), strict=True))
    with pytest.raises(ValueError, match="could not be loaded"):
        build_model("resnet8", fused_batchnorm=True).load_weights(path)


def test_build_model_refuses_an_unresolved_auto():
    with pytest.raises(ValueError, match="must be booleans, got 'auto'"):
        build_model("fast", fused_batchnorm="auto")


def test_the_estimate_takes_the_chosen_variants_timing():
    config = make_config("fast")
    performance_settings = {
        "precision": "float32",
        "precision_float32_images_per_second": "100.0",  # The precision was timed with the fused kernels.
        "fused_batchnorm": "false",
        "fused_gelu": "true",
        "kernels_images_per_second": "108.0",
    }
    estimate = estimate_training(config, performance_settings, 48, 12, 1, time_steps=None)
    assert estimate.images_per_second == pytest.approx(108.0 * PIPELINE_SHARE)
    assert estimate.source.startswith("timed: 108 images/s for fast alone in float32 with Keras's batch norm at batch")


@pytest.fixture(scope="module")
def data_dir(python_archive, tmp_path_factory) -> str:
    from cifar.config import DataConfig
    from cifar.data.prepare import prepare_data

    config = DataConfig(source=python_archive, expect_official_counts=False, validation_size=100)
    return prepare_data(config, tmp_path_factory.mktemp("kernel-data")).data_dir


@pytest.mark.slow
def test_a_run_resumed_where_the_other_batch_norm_is_faster_keeps_its_checkpoints(
    data_dir, tmp_path, monkeypatch, stopped_after_epoch
):
    """Trained with Keras's batch norm (timed faster), stopped after epoch 2, resumed on a machine that would time the
    fused one faster (a cache of its own): it resumes Keras's, untimed, and finishes."""
    import mlflow

    from cifar.train import train

    config = make_config("default", {
        "train": {"model": "resnet8", "precision": "float32", "epochs": 3, "steps_per_epoch": 2, "batch_size": 32,
                  "run_name": "kernels"},
        "tracking": {"system_metrics": False},
    })  # fmt: skip
    monkeypatch.setattr(performance, "measure_kernel_variants", Timings(fused=100.0, keras_batchnorm=130.0))
    with stopped_after_epoch(2):
        train(config, data_dir, tmp_path)
    latest = tmp_path / "runs" / "kernels" / "checkpoints" / "epoch-0002.keras"
    assert saved_kernels(latest) == {"batchnorm": False}

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "another-machine"))
    never = Timings(fused=200.0, keras_batchnorm=100.0)
    monkeypatch.setattr(performance, "measure_kernel_variants", never)
    result = train(config, data_dir, tmp_path)
    assert result.epochs_completed == 3 and never.calls == []
    tags = mlflow.MlflowClient(result.tracking_uri).get_run(result.mlflow_run_id).data.tags
    assert (tags["performance.fused_batchnorm"], tags["performance.kernels_reason"]) == ("false", "checkpoint")
    assert saved_kernels(tmp_path / "runs" / "kernels" / "checkpoints" / "epoch-0003.keras") == {"batchnorm": False}
