"""The training stage on the fixture data with the tiny model: learning, checkpoints, MLflow, failures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import keras
import mlflow
import numpy as np
import pytest

from cifar import schedules
from cifar.callbacks import TrainingDivergedError
from cifar.checkpoints import CheckpointEntry, CheckpointIndex, append_epoch, load_eval_model, load_index, updated_index
from cifar.config import DataConfig, TrainConfig, make_config
from cifar.data.prepare import prepare_data
from cifar.estimate import estimate_training
from cifar.models import build_model
from cifar.plots import plot_training_curves
from cifar.reuse import training_key
from cifar.train import TrainResult, add_weight_decay, default_run_name, train

# Peak 0.1 at batch 32 (0.4 per 128 examples): the tiny model beats chance within two epochs.
TINY = {"model": "tiny", "batch_size": 32, "learning_rate": 0.4, "schedule": "constant", "deterministic": True}


@pytest.fixture(scope="module")
def data_dir(python_archive, tmp_path_factory) -> str:
    config = DataConfig(source=python_archive, expect_official_counts=False, validation_size=100)
    return prepare_data(config, tmp_path_factory.mktemp("train-data")).data_dir


def tiny_config(**train_overrides):
    return make_config("default", {"train": {**TINY, **train_overrides}, "tracking": {"system_metrics": False}})


@pytest.mark.slow
def test_tiny_model_learns_checkpoints_and_logs_one_mlflow_run(data_dir, tmp_path):
    config = tiny_config(epochs=2, keep_checkpoints=1)
    progress: list[dict] = []
    result = train(config, data_dir, tmp_path, epoch_callback=progress.append)

    # Summary fields.
    assert isinstance(result, TrainResult)
    assert result.epochs_completed == 2
    assert result.model == "tiny"
    assert Path(result.run_dir) == tmp_path / "runs" / result.run_name
    assert result.run_name.startswith("tiny-")
    assert result.val_accuracy is not None and result.val_accuracy > 0.2  # Chance is 0.1.
    assert set(result.metrics) >= {
        "loss",
        "accuracy",
        "val_loss",
        "val_accuracy",
        "learning_rate",
        "examples_per_second",
    }
    assert [entry["epoch"] for entry in progress] == [1, 2]
    assert all(entry["epochs"] == 2 for entry in progress)
    assert progress[0]["seconds_left"] > 0 and progress[1]["seconds_left"] == 0  # The progress bar's ETA.
    # Said before training (timed by the precision choice on a CPU with bfloat16 math, else too short to time);
    # what it took is remembered for the next run here.
    assert result.estimate.startswith("Training estimate: ") and "2 epochs of 768 images in all" in result.estimate
    assert result.training_seconds > 0
    # In the precision `train.precision: auto` chose for tiny here (timed: float32 or, by a few percent of
    # noise, mixed_bfloat16 on a CPU with bfloat16 math), which the run records.
    client = mlflow.MlflowClient(tracking_uri=result.tracking_uri)
    precision = client.get_run(result.mlflow_run_id).data.tags["performance.precision"]
    again_estimate = estimate_training(config, {"precision": precision}, 2, 2, 1)
    assert again_estimate.source.startswith(f"remembered: this pipeline trained tiny in {precision}")

    # One value per epoch, and the model learns.
    history = json.loads((Path(result.run_dir) / "history.json").read_text())
    assert history["epoch"] == [1, 2]
    assert history["loss"][1] < history["loss"][0]
    assert math.isclose(history["learning_rate"][0], 0.1, rel_tol=1e-6)  # 0.4 * 32 / 128.

    # Checkpoints: the latest and the best are kept, and the evaluation model loads.
    index = load_index(result.checkpoint_dir)
    assert index.latest.epoch == 2
    assert index.best_epoch == result.best_epoch
    assert {entry.epoch for entry in index.entries} == {2, result.best_epoch}
    for entry in index.entries:
        assert (Path(result.checkpoint_dir) / entry.model_path).is_file()
        assert (Path(result.checkpoint_dir) / entry.eval_weights_path).is_file()
    model = load_eval_model(result.checkpoint_dir, index.latest)
    assert model.output_shape == (None, 10)
    assert not list(Path(result.checkpoint_dir).glob(".tmp-*"))

    # MLflow: one run with every config field, per-epoch metrics, artifacts, inputs and tags.
    state = json.loads((Path(result.run_dir) / "state.json").read_text())
    assert state["mlflow_run_id"] == result.mlflow_run_id
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert set(config.flat()) - {"tracking.run_name"} <= set(run.data.params)  # The run name is the run's name.
    assert run.data.params["train.model"] == "tiny"
    # Single values a person compares, and keys as tags (the compare page plots params only).
    assert run.data.metrics["best_val_accuracy"] == pytest.approx(result.val_accuracy)
    assert run.data.metrics["training_time_s"] > 0 and run.data.metrics["epochs_completed"] == 2
    assert run.data.tags["derived.training_key"] == result.key and "derived.training_key" not in run.data.params
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "learning_rate", "examples_per_second"):
        assert [metric.step for metric in client.get_metric_history(run.info.run_id, key)] == [1, 2], key
    artifacts = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    assert {"training_curves.png", "config.json", "manifest.json", "history.json"} <= artifacts
    assert run.data.tags["model"] == "tiny"
    assert "git_commit" in run.data.tags
    assert "1 replica" in run.data.tags["devices"]
    assert "performance.precision" in run.data.tags
    assert run.data.tags["estimate"] == result.estimate
    assert len(run.inputs.dataset_inputs) == 1
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    assert len(client.search_runs([experiment.experiment_id])) == 1

    # A completed run re-invoked returns its result without training.
    again: list[dict] = []
    reused = train(config, data_dir, tmp_path, epoch_callback=again.append)
    assert reused.reused and reused.model_dump(exclude={"reused"}) == result.model_dump(exclude={"reused"})
    assert again == []
    assert len(client.search_runs([experiment.experiment_id])) == 1


@pytest.mark.slow
def test_fresh_start_discards_the_old_run_and_opens_a_new_mlflow_run(data_dir, tmp_path):
    first = train(tiny_config(epochs=1, steps_per_epoch=2), data_dir, tmp_path)
    fresh = train(tiny_config(epochs=1, steps_per_epoch=2, resume=False), data_dir, tmp_path)
    assert fresh.run_name == first.run_name  # `resume` does not change the run's identity.
    assert fresh.mlflow_run_id != first.mlflow_run_id
    assert fresh.epochs_completed == 1
    assert [path.name for path in (tmp_path / "runs").iterdir()] == [first.run_name]


@pytest.mark.slow
def test_diverging_loss_stops_with_a_clear_error_and_no_checkpoint(data_dir, tmp_path):
    config = tiny_config(epochs=1, learning_rate=100.0, weight_decay=0.0)
    with pytest.raises(TrainingDivergedError, match="lower the learning rate"):
        train(config, data_dir, tmp_path)
    run_dir = next((tmp_path / "runs").iterdir())
    assert load_index(run_dir / "checkpoints").entries == []
    assert not list((run_dir / "checkpoints").glob("epoch-*"))
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "diverged"
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(state["mlflow_run_id"]).info.status == "FAILED"


@pytest.mark.slow
def test_ema_checkpoints_hold_ema_weights_for_evaluation_and_raw_weights_for_resume(data_dir, tmp_path):
    config = tiny_config(
        epochs=1, steps_per_epoch=6, ema_decay=0.9, label_smoothing=0.1, schedule="onecycle", warmup_epochs=0.5
    )
    result = train(config, data_dir, tmp_path)
    entry = load_index(result.checkpoint_dir).latest
    raw = keras.models.load_model(Path(result.checkpoint_dir) / entry.model_path, compile=False)
    evaluation = load_eval_model(result.checkpoint_dir, entry)
    raw_kernel = raw.get_layer("conv").kernel.numpy()
    ema_kernel = evaluation.get_layer("conv").kernel.numpy()
    assert not np.allclose(raw_kernel, ema_kernel)
    assert result.val_accuracy is not None


def test_batch_larger_than_the_training_split_is_rejected(data_dir, tmp_path):
    with pytest.raises(ValueError, match="larger than the 400 training examples"):
        train(tiny_config(epochs=1, batch_size=512), data_dir, tmp_path)


def test_default_run_name_is_stable_and_ignores_resume_and_run_name():
    def name_of(config, data="data-a"):
        return default_run_name(config.train.model, training_key(config, data))

    base = tiny_config(epochs=3)
    name = name_of(base)
    assert name.startswith("tiny-")
    assert name_of(tiny_config(epochs=3, resume=False, run_name="custom")) == name
    assert name_of(tiny_config(epochs=4)) != name
    assert name_of(base, "data-b") != name
    assert (
        name_of(
            make_config("default", {"seed": 1, "train": {**TINY, "epochs": 3}, "tracking": {"system_metrics": False}})
        )
        != name
    )


def make_schedule(name: str, *, steps_per_epoch: int, **fields):
    """A schedule from training settings, as training builds it."""
    return schedules.make_schedule(TrainConfig(schedule=name, **fields), steps_per_epoch)


def test_schedules_follow_their_recipes():
    steps, epochs = 10, 164
    piecewise = make_schedule("piecewise", learning_rate=0.1, batch_size=256, steps_per_epoch=steps, epochs=epochs)
    peak = 0.2  # Linear scaling: 0.1 at batch 128 -> 0.2 at batch 256.
    for epoch, multiplier in [(0, 1.0), (81, 1.0), (82, 0.1), (122, 0.1), (123, 0.01), (150, 0.002), (163, 0.002)]:
        assert math.isclose(float(piecewise(epoch * steps)), peak * multiplier, rel_tol=1e-5), epoch

    cosine = make_schedule("cosine", learning_rate=0.1, batch_size=128, steps_per_epoch=10, epochs=10, warmup_epochs=1)
    assert float(cosine(0)) == pytest.approx(0.01)  # First warm-up step.
    assert float(cosine(10)) == pytest.approx(0.1)
    assert float(cosine(55)) == pytest.approx(0.05)
    assert float(cosine(100)) == pytest.approx(0.0, abs=1e-7)

    onecycle = make_schedule(
        "onecycle", learning_rate=0.4, batch_size=512, steps_per_epoch=10, epochs=10, warmup_epochs=2
    )
    values = [float(onecycle(step)) for step in range(100)]
    assert max(values) == pytest.approx(1.6)  # 0.4 * 512 / 128.
    assert int(np.argmax(values)) == 19
    assert float(onecycle(100)) == pytest.approx(0.0, abs=1e-7)
    assert all(later <= earlier for earlier, later in zip(values[19:], values[20:]))

    constant = make_schedule("constant", learning_rate=0.05, batch_size=64, steps_per_epoch=5, epochs=2)
    assert {round(float(constant(step)), 7) for step in range(10)} == {0.025}

    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(onecycle))
    assert float(restored(30)) == pytest.approx(float(onecycle(30)))
    with pytest.raises(ValueError, match="unknown schedule"):
        schedules.make_schedule(
            TrainConfig.model_construct(
                schedule="step", learning_rate=0.1, batch_size=128, epochs=1, warmup_epochs=0.0
            ),
            1,
        )


def _entry(epoch: int, accuracy: float | None) -> CheckpointEntry:
    metrics = {"loss": 1.0} if accuracy is None else {"loss": 1.0, "val_accuracy": accuracy}
    return CheckpointEntry(epoch=epoch, model_path=f"m{epoch}", eval_weights_path=f"w{epoch}", metrics=metrics)


def test_index_keeps_the_last_k_and_the_best_by_validation_accuracy():
    index = CheckpointIndex()
    for epoch, accuracy in enumerate([0.3, 0.9, 0.5, 0.6, 0.7], start=1):
        index = updated_index(index, _entry(epoch, accuracy), keep=2)
    assert [entry.epoch for entry in index.entries] == [2, 4, 5]
    assert index.best_epoch == 2
    # Without validation the best is the latest.
    index = CheckpointIndex()
    for epoch in range(1, 4):
        index = updated_index(index, _entry(epoch, None), keep=1)
    assert [entry.epoch for entry in index.entries] == [3]
    assert index.best_epoch == 3


def test_training_curves_plot_is_written(tmp_path):
    history = {
        "epoch": [1, 2, 3],
        "loss": [2.0, 1.5, 1.2],
        "val_loss": [2.1, 1.6, 1.4],
        "accuracy": [0.2, 0.4, 0.5],
        "learning_rate": [0.1, 0.1, 0.01],
    }
    path = plot_training_curves(history, tmp_path / "plots" / "curves.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_history_keeps_one_value_per_epoch_in_every_column():
    history: dict[str, list] = {}
    append_epoch(history, 1, {"loss": 2.0})
    append_epoch(history, 2, {"loss": 1.5, "examples_per_second": 900.0})
    append_epoch(history, 3, {"examples_per_second": 950.0})
    assert history == {"epoch": [1, 2, 3], "loss": [2.0, 1.5, None], "examples_per_second": [None, 900.0, 950.0]}


def test_weight_decay_applies_to_kernels_only():
    model = build_model("tiny")
    decayed = add_weight_decay(model, 2e-4)
    assert decayed == ["conv/kernel", "logits/kernel"]
    assert len(model.losses) == 2
    kernel = model.get_layer("conv").kernel
    # The penalty is weight_decay / 2 * sum(w ** 2): its gradient is weight_decay * w.
    expected = 1e-4 * float(np.sum(kernel.numpy() ** 2))
    assert float(kernel.regularizer(kernel)) == pytest.approx(expected, rel=1e-5)
    assert add_weight_decay(build_model("tiny"), 0.0) == []


@pytest.mark.slow
@pytest.mark.parametrize("precise_bn_images", [0, 64])
def test_validation_and_checkpoints_use_precise_batch_norm_statistics(data_dir, tmp_path, precise_bn_images):
    """With precise BN the checkpoint holds the statistics of the first training images; without, the lagging
    moving averages (two steps at momentum 0.997 leave them near their initial zeros and ones)."""
    from cifar.callbacks import batch_norm_recomputer
    from cifar.input_pipeline import make_eval_dataset

    # Precise statistics, not the kernel choice (tests/test_kernel_choice.py): nothing timed.
    config = tiny_config(
        model="resnet8", epochs=1, steps_per_epoch=2, precise_bn_images=precise_bn_images, fused_batchnorm=True
    )
    result = train(config, data_dir, tmp_path)
    entry = load_index(result.checkpoint_dir).latest
    model = keras.models.load_model(Path(result.checkpoint_dir) / entry.model_path, compile=False)
    saved = model.get_layer("stem_bn").moving_variance.numpy().copy()
    if not precise_bn_images:
        assert np.allclose(saved, 1.0, atol=0.05)
        return
    batches = make_eval_dataset(data_dir, splits=["train"], batch_size=32, image_size=32).take(2)
    assert batch_norm_recomputer(model)(batches) == 64
    np.testing.assert_allclose(saved, model.get_layer("stem_bn").moving_variance.numpy(), rtol=1e-4)
    assert not np.allclose(saved, 1.0, atol=0.05)
