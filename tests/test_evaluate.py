"""Evaluate stage: given a briefly trained tiny model on the fixture archive, expect complete, consistent outputs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import keras
import mlflow
import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import TEST_EXAMPLES

from cifar import calibration, plots, trust
from cifar.checkpoints import CheckpointEntry, CheckpointIndex, checkpoint_file_names, write_index
from cifar.config import DataConfig, make_config
from cifar.data.manifest import load_manifest
from cifar.data.prepare import prepare_data
from cifar.data.synthetic import CLASS_NAMES
from cifar.evaluate import confusion_matrix, evaluate, load_split, per_class_metrics
from cifar.input_pipeline import center_crop
from cifar.models import build_model, input_size


def prepare_fixture_data(archive: str, workdir: Path) -> Path:
    """The data stage on a fixture archive: TFRecord shards and manifest under `workdir`."""
    config = DataConfig(source=archive, expect_official_counts=False, validation_size=100)
    return Path(prepare_data(config, workdir).data_dir)


def write_checkpoints(
    data_dir: Path,
    checkpoint_dir: Path,
    model_name: str = "tiny",
    epochs: int = 2,
    best_epoch: int | None = None,
    seed: int = 0,
) -> CheckpointIndex:
    """Trains a model one short epoch at a time and writes checkpoints in the trainer's contract."""
    keras.utils.set_random_seed(seed)
    manifest = load_manifest(data_dir)
    images, labels = load_split(data_dir, "train")
    images = center_crop(images, input_size(model_name)).astype("float32")
    model = build_model(model_name, mean=manifest.mean, std=manifest.std)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for epoch in range(1, epochs + 1):
        model.fit(images, labels, epochs=1, batch_size=50, verbose=0)
        model_file, weights_file = checkpoint_file_names(epoch)
        model.save(checkpoint_dir / model_file)
        model.save_weights(checkpoint_dir / weights_file)
        entries.append(
            CheckpointEntry(
                epoch=epoch,
                model_path=model_file,
                eval_weights_path=weights_file,
                metrics={"val_accuracy": 0.5 + 0.01 * epoch, "val_loss": 1.0},
            )
        )
    index = CheckpointIndex(entries=entries, best_epoch=best_epoch or epochs)
    write_index(checkpoint_dir, index)
    return index


@pytest.fixture(scope="module")
def trained(python_archive, tmp_path_factory) -> dict:
    """A workdir with prepared data and two checkpoints of a tiny model (the first one is the best)."""
    workdir = tmp_path_factory.mktemp("evaluate")
    data_dir = prepare_fixture_data(python_archive, workdir)
    checkpoint_dir = workdir / "runs" / "tiny-test" / "checkpoints"
    write_checkpoints(data_dir, checkpoint_dir, epochs=2, best_epoch=1)
    return {"workdir": workdir, "data_dir": data_dir, "checkpoint_dir": checkpoint_dir}


@pytest.mark.slow
def test_evaluate_writes_consistent_metrics_predictions_and_plots(trained):
    evaluate_settings = {"checkpoints": "all", "flip_tta": True, "calibration": False, "robustness_images": 0}
    config = make_config("default", {"train": {"model": "tiny"}, "evaluate": evaluate_settings})
    result = evaluate(
        config,
        trained["data_dir"],
        trained["checkpoint_dir"],
        trained["workdir"],
        mlflow_run_id=None,
        tracking_uri=None,
    )

    # The best epoch by validation accuracy is evaluated, not the last or the best on test.
    assert result.epoch == 1
    assert Path(result.metrics_path).parent == trained["checkpoint_dir"].parent / "evaluation"
    metrics = json.loads(Path(result.metrics_path).read_text())
    matrix = np.array(metrics["confusion_matrix"])
    assert matrix.shape == (10, 10)
    assert matrix.sum() == TEST_EXAMPLES == metrics["num_examples"]
    assert metrics["correct"] == np.trace(matrix)
    assert metrics["test_accuracy"] == pytest.approx(np.trace(matrix) / TEST_EXAMPLES)
    assert result.test_accuracy == metrics["test_accuracy"] and result.correct == metrics["correct"]
    assert metrics["class_names"] == list(CLASS_NAMES)
    assert set(metrics["per_class"]) == set(CLASS_NAMES)
    assert all(
        set(values) == {"precision", "recall", "accuracy", "support"} for values in metrics["per_class"].values()
    )
    assert 0 <= result.flip_tta_accuracy <= 1 and np.isfinite(result.test_loss) and result.test_loss > 0
    assert [row["epoch"] for row in result.per_checkpoint] == [1, 2]

    table = pq.read_table(result.predictions_path).to_pandas()
    assert len(table) == TEST_EXAMPLES
    assert table["index"].tolist() == list(range(TEST_EXAMPLES))
    _, labels = load_split(trained["data_dir"], "test")
    assert table["label"].tolist() == labels.tolist()
    probabilities = table[[f"prob_{index}" for index in range(10)]].to_numpy()
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    assert (probabilities.argmax(axis=1) == table["predicted"].to_numpy()).all()
    assert int(table["correct"].sum()) == metrics["correct"]

    for plot in (result.confusion_matrix_plot, result.misclassified_plot):
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(Path(result.metrics_path).parent.glob(".*.tmp"))  # Atomic writes leave no temp files.
    # Calibration and robustness turned off: nothing measured, nothing written.
    assert result.trust_path is None and result.temperature is None and result.mean_corruption_accuracy is None
    assert not (Path(result.metrics_path).parent / trust.TRUST_NAME).exists()


@pytest.mark.slow
def test_evaluate_logs_metrics_at_the_checkpoint_epoch_and_artifacts(trained, tmp_path):
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    experiment_id = client.create_experiment("cifar10", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment_id).info.run_id
    # Robustness on 40 of the 200 test images: every corruption and severity, at a test's cost.
    config = make_config(
        "default", {"train": {"model": "tiny"}, "evaluate": {"flip_tta": False, "robustness_images": 40}}
    )

    result = evaluate(
        config,
        trained["data_dir"],
        trained["checkpoint_dir"],
        trained["workdir"],
        mlflow_run_id=run_id,
        tracking_uri=tracking_uri,
        output_dir=tmp_path / "evaluation",
    )

    assert result.flip_tta_accuracy is None and len(result.per_checkpoint) == 1
    history = client.get_metric_history(run_id, "test_accuracy")
    assert [(point.step, point.value) for point in history] == [(1, result.test_accuracy)]
    run = client.get_run(run_id)
    assert "test_accuracy_flip_tta" not in run.data.metrics  # Flip TTA off in this config.
    assert not any(name.startswith("test_recall_") for name in run.data.metrics)  # In evaluation/metrics.json.
    logged = {artifact.path for artifact in client.list_artifacts(run_id, "evaluation")}
    assert logged == {
        "evaluation/metrics.json",
        "evaluation/predictions.parquet",
        "evaluation/confusion_matrix.png",
        "evaluation/misclassified.png",
        "evaluation/trust.json",
        "evaluation/reliability.png",
        "evaluation/corruptions.png",
        "evaluation/robustness_correct.npz",
    }

    # Calibration: a temperature fitted on the 100 validation images, applied to the test answers.
    report = trust.load_report(result.trust_path)
    assert report.temperature_images == 100 and report.temperature == result.temperature > 0
    table = pq.read_table(result.predictions_path).to_pandas()
    probabilities = table[[f"prob_{index}" for index in range(10)]].to_numpy()
    scaled = calibration.softmax(np.log(probabilities), report.temperature)
    expected_ece = calibration.expected_calibration_error(scaled, table["label"].to_numpy())
    assert report.calibration_after["ece"] == pytest.approx(expected_ece) == result.ece
    assert report.calibration_before["ece"] == pytest.approx(
        calibration.expected_calibration_error(probabilities, table["label"].to_numpy())
    )
    assert set(report.selective_accuracy) == {"50", "80", "90", "95"}
    # Robustness: 15 corruptions x 5 severities on the same 40 images, and each image's answer kept.
    assert report.robustness_images == 40 and len(report.corruption_accuracy) == 15
    correct = report.correct()
    for name, values in report.corruption_accuracy.items():
        assert correct[name].shape == (5, 40) and values == pytest.approx(correct[name].mean(axis=1).tolist())
    metrics = run.data.metrics
    assert metrics["robustness.mean_corruption_accuracy"] == pytest.approx(result.mean_corruption_accuracy, abs=1e-6)
    assert metrics["calibration.temperature"] == pytest.approx(report.temperature, rel=1e-6)
    assert {"calibration.ece_before", "selective.accuracy_at_90", "robustness.drop", "robustness.fog"} <= set(metrics)
    # The corrupted images are made once per workdir, keyed by their content.
    assert len(list((trained["workdir"] / "data" / trust.CORRUPTION_CACHE).glob("*.npy"))) == 15


def test_metric_helpers_on_a_known_confusion():
    labels = np.array([0, 0, 1, 1, 2])
    predictions = np.array([0, 1, 1, 1, 0])
    matrix = confusion_matrix(labels, predictions, num_classes=3)
    assert matrix.tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 0]]
    metrics = per_class_metrics(matrix, ["a", "b", "c"])
    assert metrics["a"] == {"precision": 0.5, "recall": 0.5, "accuracy": 0.5, "support": 2}
    assert metrics["b"]["precision"] == pytest.approx(2 / 3) and metrics["b"]["recall"] == 1.0
    assert metrics["c"] == {"precision": 0.0, "recall": 0.0, "accuracy": 0.0, "support": 1}


def test_center_crop_matches_tensorflow_and_rejects_oversized_crops():
    import tensorflow as tf

    images = np.random.default_rng(0).integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
    expected = tf.image.resize_with_crop_or_pad(images, 24, 24).numpy()
    np.testing.assert_array_equal(center_crop(images, 24), expected)
    with pytest.raises(ValueError):
        center_crop(images, 40)


def test_the_misclassified_grid_shows_each_image_apart_or_says_there_is_none():
    from PIL import Image
    from scipy import ndimage

    images = np.zeros((5, 32, 32, 3), np.uint8)
    images[..., 0] = 255  # Red squares on white: each must come out whole and apart from the others.
    png = plots.misclassified_grid_png(images, [0] * 5, [1] * 5, CLASS_NAMES)
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    red = (pixels[..., 0] > 200) & (pixels[..., 1] < 60) & (pixels[..., 2] < 60)
    regions, count = ndimage.label(red)
    assert count == 5 and all(size > 32 * 32 for size in np.bincount(regions.ravel())[1:])
    assert plots.misclassified_grid_png(images[:0], [], [], CLASS_NAMES)[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="got 5 images, 4 labels"):
        plots.misclassified_grid_png(images, [0] * 4, [1] * 5, CLASS_NAMES)
