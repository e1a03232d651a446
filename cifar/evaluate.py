"""The evaluate stage: test-split metrics of the chosen checkpoint(s), written to runs/<run>/evaluation/ and MLflow."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cifar import calibration, failpoints, plots, trust
from cifar.calibration import softmax
from cifar.checkpoints import CheckpointEntry, index_digest, load_eval_model, load_index, select_for_evaluation
from cifar.config import EvaluateConfig, PipelineConfig
from cifar.data.manifest import IMAGE_SHAPE, NEW_DATA_SLICE, NUM_CLASSES, Manifest, load_manifest
from cifar.io import atomic_write_bytes, atomic_write_json, read_json
from cifar.results import EvaluationResult
from cifar.reuse import evaluation_key
from cifar.tracking import finite_metrics, resolve_tracking_uri, use_run

READ_BATCH = 1024  # Serialized examples parsed per step when reading a split.
# The files of runs/<run>/evaluation/:
RESULT_NAME = "result.json"  # The stage's result and key, written last: the evaluation is reusable once it exists.
METRICS_NAME = "metrics.json"  # Accuracy, loss, per-class precision/recall/accuracy, confusion matrix.
PREDICTIONS_NAME = "predictions.parquet"  # One row per test image: index, label, predicted, prob_0..prob_9.
CONFUSION_MATRIX_NAME = "confusion_matrix.png"  # Counts, rows = true class.
MISCLASSIFIED_NAME = "misclassified.png"  # The first misclassified test images with true / predicted class.


def load_split(data_dir: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Every example of a split, in shard order: images (N, 32, 32, 3) uint8 and labels (N,) int64."""
    import tensorflow as tf

    from cifar.input_pipeline import parse_batch

    manifest = load_manifest(data_dir)
    if split not in manifest.splits:
        raise ValueError(f"unknown split {split!r}: expected one of {', '.join(manifest.splits)}")
    # One reader, no shuffling, no interleaving: every example exactly once, in the manifest's order.
    dataset = tf.data.TFRecordDataset(manifest.shard_paths(data_dir, split)).batch(READ_BATCH).map(parse_batch)
    images, labels = [], []
    for batch_images, batch_labels in dataset:
        images.append(batch_images.numpy())  # (B, 32, 32, 3)
        labels.append(batch_labels.numpy().astype(np.int64))
    if not images:
        return np.zeros((0, *IMAGE_SHAPE), np.uint8), np.zeros((0,), np.int64)
    images_array, labels_array = np.concatenate(images), np.concatenate(labels)
    expected = manifest.splits[split].num_examples
    if len(labels_array) != expected:
        raise ValueError(f"{split} split has {len(labels_array)} examples, the manifest says {expected}")
    return images_array, labels_array


def near_duplicate_test_images(data_dir: str | Path, manifest: Manifest) -> np.ndarray:
    """Indices of the test images with a near-duplicate in the training batches (empty when none are listed)."""
    import pyarrow.parquet as pq

    if not manifest.near_duplicates_file:
        return np.zeros(0, np.int64)
    table = pq.read_table(Path(data_dir) / manifest.near_duplicates_file, columns=["test_index"])
    return np.unique(table.column("test_index").to_numpy()).astype(np.int64)


def slice_examples(data_dir: str | Path, manifest: Manifest, name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(images, labels) of a named slice of a split (e.g. `new_data`), or None when the data has no such slice."""
    info = manifest.slices.get(name)
    if info is None or info.stop <= info.start:
        return None
    images, labels = load_split(data_dir, info.split)
    return images[info.start : info.stop], labels[info.start : info.stop]


def model_input_size(model) -> int:
    """The side length of the images a Keras model takes (24 for the tutorial CNN, else 32)."""
    return int(model.input_shape[1])


def logits_function(model, batch_size: int, *, flip: bool = False) -> Callable[[np.ndarray], np.ndarray]:
    """uint8 images (already cropped to the model's size) -> float32 logits (N, 10), in batches.

    The model's forward pass is traced once for every call of the returned function (a function traced
    per call costs a trace each time: TensorFlow warns after five)."""
    import tensorflow as tf

    @tf.function(reduce_retracing=True)
    def forward(batch: tf.Tensor) -> tf.Tensor:
        batch = tf.cast(batch, tf.float32)
        if flip:
            batch = tf.reverse(batch, axis=[2])  # Horizontal flip: reverse the width axis.
        return tf.cast(model(batch, training=False), tf.float32)

    def logits(images: np.ndarray) -> np.ndarray:
        batches = (images[start : start + batch_size] for start in range(0, len(images), batch_size))
        outputs = [forward(tf.constant(batch)).numpy() for batch in batches]
        return np.concatenate(outputs) if outputs else np.zeros((0, NUM_CLASSES), np.float32)

    return logits


def checkpoint_logits(checkpoint_dir: str | Path, entry: CheckpointEntry, batch_size: int) -> Callable:
    """uint8 images (N, 32, 32, 3) -> logits of a checkpoint's evaluation weights, cropped as the export crops."""
    from cifar.input_pipeline import center_crop

    model = load_eval_model(checkpoint_dir, entry)
    size = model_input_size(model)
    forward = logits_function(model, batch_size)
    return lambda images: forward(center_crop(images, size))


def predict_logits(model, images: np.ndarray, batch_size: int, *, flip: bool = False) -> np.ndarray:
    """Float32 logits (N, 10) of uint8 images (already cropped to the model's size), in batches."""
    return logits_function(model, batch_size, flip=flip)(images)


def translated(images: np.ndarray, rows: int, columns: int) -> np.ndarray:
    """Images shifted by (rows, columns) pixels (each -1, 0 or 1), the border filled by reflection."""
    padded = np.pad(images, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="reflect")
    height, width = images.shape[1:3]
    return padded[:, 1 - rows : 1 - rows + height, 1 - columns : 1 - columns + width, :]


def mirrored_logits(model, images: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(logits of the images, logits of their mirror images)."""
    return predict_logits(model, images, batch_size), predict_logits(model, images, batch_size, flip=True)


def tta_logits(
    model, images: np.ndarray, batch_size: int, mirrored: tuple[np.ndarray, np.ndarray] | None = None
) -> np.ndarray:
    """airbench94's test-time augmentation (level 2) as logits: flips and 1-pixel translations.

    Half the weight is the mean of the image and its mirror; the other half is the same for the
    image shifted one pixel down-right and one pixel up-left (reflect-padded), averaged. Pass the
    unshifted views' `mirrored_logits` when they are already computed.
    """

    def mirror_mean(batch: np.ndarray) -> np.ndarray:
        return 0.5 * sum(mirrored_logits(model, batch, batch_size))

    unshifted = 0.5 * sum(mirrored) if mirrored is not None else mirror_mean(images)
    shifted = 0.5 * (mirror_mean(translated(images, 1, 1)) + mirror_mean(translated(images, -1, -1)))
    return 0.5 * unshifted + 0.5 * shifted


def cross_entropy(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Mean negative log-likelihood of the true labels (NaN without images)."""
    return calibration.negative_log_likelihood(probabilities, labels) if len(labels) else float("nan")


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int = NUM_CLASSES) -> np.ndarray:
    """Counts (num_classes, num_classes): rows are true classes, columns predicted classes."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (labels.astype(np.int64), predictions.astype(np.int64)), 1)
    return matrix


def per_class_metrics(matrix: np.ndarray, class_names: Sequence[str]) -> dict[str, dict[str, float]]:
    """Precision, recall and accuracy per class from a confusion matrix.

    A class's accuracy is the share of its test images classified correctly (equal to its recall),
    the usual CIFAR-10 "accuracy of class X". Undefined ratios (no support) are reported as 0.
    """
    true_positives = np.diag(matrix).astype(np.float64)
    predicted = matrix.sum(axis=0).astype(np.float64)
    support = matrix.sum(axis=1).astype(np.float64)
    precision = np.divide(true_positives, predicted, out=np.zeros_like(true_positives), where=predicted > 0)
    recall = np.divide(true_positives, support, out=np.zeros_like(true_positives), where=support > 0)
    return {
        name: {
            "precision": float(precision[index]),
            "recall": float(recall[index]),
            "accuracy": float(recall[index]),
            "support": int(support[index]),
        }
        for index, name in enumerate(class_names)
    }


def score(probabilities: np.ndarray, labels: np.ndarray) -> dict[str, float | int]:
    """Accuracy (from the exact count of correct predictions) and cross-entropy of probabilities."""
    predictions = probabilities.argmax(axis=1)
    correct = int(np.sum(predictions == labels))
    accuracy = correct / len(labels) if len(labels) else float("nan")
    return {"accuracy": accuracy, "loss": cross_entropy(probabilities, labels), "correct": correct}


def predictions_table_bytes(
    labels: np.ndarray, probabilities: np.ndarray, flip_probabilities: np.ndarray | None
) -> bytes:
    """Parquet bytes with one row per test image: index, label, predicted, correct, prob_0..prob_9."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    predictions = probabilities.argmax(axis=1)
    columns: dict[str, Any] = {
        "index": pa.array(np.arange(len(labels), dtype=np.int64)),
        "label": pa.array(labels.astype(np.int64)),
        "predicted": pa.array(predictions.astype(np.int64)),
        "correct": pa.array(predictions == labels),
    }
    for class_index in range(probabilities.shape[1]):
        columns[f"prob_{class_index}"] = pa.array(probabilities[:, class_index].astype(np.float32))
    if flip_probabilities is not None:
        columns["predicted_flip_tta"] = pa.array(flip_probabilities.argmax(axis=1).astype(np.int64))
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer)
    return buffer.getvalue()


def evaluate_checkpoint(
    checkpoint_dir: Path,
    entry: CheckpointEntry,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    batch_size: int,
    flip_tta: bool,
    translate_tta: bool = False,
) -> dict[str, Any]:
    """Scores one checkpoint's evaluation weights: probabilities, accuracy, loss and (optionally) TTA."""
    from cifar.input_pipeline import center_crop

    model = load_eval_model(checkpoint_dir, entry)  # Its evaluation (EMA) weights.
    # A model trained on crops (the tutorial CNN, 24x24) sees the centre of each image, as the exported one does.
    cropped = center_crop(images, model_input_size(model))
    # The mirror images' logits serve both TTA scores, so they are computed once.
    views = mirrored_logits(model, cropped, batch_size) if flip_tta or translate_tta else None
    logits = views[0] if views is not None else predict_logits(model, cropped, batch_size)
    probabilities = softmax(logits)
    outcome: dict[str, Any] = {"probabilities": probabilities, **score(probabilities, labels)}
    outcome["flip_probabilities"] = None
    if flip_tta:
        # Test-time augmentation: average the softmax of each image and its mirror image.
        outcome["flip_probabilities"] = (probabilities + softmax(views[1])) / 2
        outcome["flip_tta_accuracy"] = score(outcome["flip_probabilities"], labels)["accuracy"]
    if translate_tta:
        outcome["tta_accuracy"] = score(softmax(tta_logits(model, cropped, batch_size, views)), labels)["accuracy"]
    return outcome


def log_to_mlflow(
    tracking_uri: str,
    run_id: str,
    epoch: int,
    metrics: dict[str, Any],
    per_checkpoint: list[dict],
    output_dir: Path,
    measured: trust.TrustReport | None = None,
) -> None:
    """Test metrics at step = the checkpoint's epoch (calibration and robustness too), and the evaluation files
    under `evaluation/`."""
    import mlflow

    with use_run(tracking_uri, run_id):
        for row in per_checkpoint:
            if row["epoch"] != epoch:
                mlflow.log_metrics({"test_accuracy": row["accuracy"], "test_loss": row["loss"]}, step=row["epoch"])
        values = {"test_accuracy": metrics["test_accuracy"], "test_loss": metrics["test_loss"]}
        if metrics["flip_tta_accuracy"] is not None:
            values["test_accuracy_flip_tta"] = metrics["flip_tta_accuracy"]
        if metrics.get("tta_accuracy") is not None:
            values["test_accuracy_tta"] = metrics["tta_accuracy"]
        values["test_accuracy_deduplicated"] = metrics.get("test_accuracy_deduplicated")
        values["new_data_accuracy"] = metrics.get("new_data_accuracy")
        # Per-class precision and recall stay in evaluation/metrics.json: twenty more charts hide the ones compared.
        if measured is not None:
            values.update(measured.metrics())
        mlflow.log_metrics(finite_metrics(values), step=epoch)
        mlflow.set_tag("evaluation.epoch", str(epoch))
        mlflow.log_artifacts(str(output_dir), artifact_path="evaluation")


# The values of metrics.json that the stage's result carries too.
RESULT_METRICS = (
    "epoch",
    "test_accuracy",
    "test_loss",
    "flip_tta_accuracy",
    "tta_accuracy",
    "num_examples",
    "correct",
    "test_accuracy_deduplicated",
    "deduplicated_examples",
    "new_data_accuracy",
    "new_data_examples",
)


def evaluate(
    config: PipelineConfig,
    data_dir: str | Path,
    checkpoint_dir: str | Path,
    workdir: str | Path,
    *,
    refresh: bool = False,
    mlflow_run_id: str | None = None,
    tracking_uri: str | None = None,
    output_dir: str | Path | None = None,
) -> EvaluationResult:
    """Evaluates the best (or every kept) checkpoint on the test split; writes files, logs to MLflow.

    An evaluation of the same checkpoints, data, settings and code (same key) is returned as it is
    unless `refresh`.
    """
    checkpoint_dir = Path(checkpoint_dir)
    output_dir = Path(output_dir) if output_dir is not None else checkpoint_dir.parent / "evaluation"
    manifest = load_manifest(data_dir)
    key = evaluation_key(config, manifest.key or "", index_digest(checkpoint_dir))
    finished = None if refresh else find_evaluation(output_dir, key)
    if finished is not None:
        return finished
    images, labels = load_split(data_dir, "test")
    if len(labels) == 0:
        raise ValueError(f"the test split in {data_dir} is empty: nothing to evaluate")
    chosen, best_outcome, per_checkpoint = score_checkpoints(config.evaluate, checkpoint_dir, images, labels)
    metrics = checkpoint_metrics(config, data_dir, manifest, checkpoint_dir, chosen, best_outcome, labels)
    metrics["per_checkpoint"] = per_checkpoint
    files = write_evaluation_files(output_dir, config.evaluate, manifest, images, labels, best_outcome, metrics)
    has_validation = config.evaluate.calibration and "validation" in manifest.splits
    validation = load_split(data_dir, "validation") if has_validation else (images[:0], labels[:0])
    test = (images, labels, best_outcome["probabilities"])
    cache = trust.corruption_cache(data_dir)
    chosen_logits = functools.partial(checkpoint_logits, checkpoint_dir, chosen, config.evaluate.batch_size)
    measured = trust.measure(config.evaluate, chosen_logits, test, validation, output_dir, cache)
    if mlflow_run_id:
        tracking_uri = tracking_uri or resolve_tracking_uri(config.tracking, workdir)
        log_to_mlflow(tracking_uri, mlflow_run_id, chosen.epoch, metrics, per_checkpoint, output_dir, measured)
    result = EvaluationResult(
        key=key,
        **{name: metrics[name] for name in RESULT_METRICS},
        **files,
        per_checkpoint=per_checkpoint,
        trust_path=str(output_dir / trust.TRUST_NAME) if measured else None,
        temperature=measured.temperature if measured else None,
        ece=measured.ece if measured else None,
        ece_before=measured.calibration_before["ece"] if measured and measured.calibration_before else None,
        mean_corruption_accuracy=measured.mean_corruption_accuracy if measured else None,
    )
    failpoints.reached("evaluate.scored")
    atomic_write_json(output_dir / RESULT_NAME, result.model_dump(exclude={"reused"}))
    return result


def score_checkpoints(
    settings: EvaluateConfig, checkpoint_dir: Path, images: np.ndarray, labels: np.ndarray
) -> tuple[CheckpointEntry, dict[str, Any], list[dict]]:
    """(the chosen checkpoint, its outcome, one row per scored checkpoint) on the test images.

    The checkpoint is chosen on validation accuracy (the index's `best_epoch`), never on test; with
    `evaluate.checkpoints == "all"` every kept checkpoint is scored as well, for the learning curve.
    """
    index = load_index(checkpoint_dir)
    chosen = select_for_evaluation(index, "best")[0]  # By validation accuracy, never by test.
    per_checkpoint: list[dict] = []
    best_outcome: dict[str, Any] | None = None
    for entry in select_for_evaluation(index, settings.checkpoints):
        is_chosen = entry.epoch == chosen.epoch
        tta = {"flip_tta": settings.flip_tta and is_chosen, "translate_tta": settings.translate_tta and is_chosen}
        outcome = evaluate_checkpoint(checkpoint_dir, entry, images, labels, batch_size=settings.batch_size, **tta)
        row = {"epoch": entry.epoch, **{key: outcome[key] for key in ("accuracy", "loss", "correct")}}
        if "val_accuracy" in entry.metrics:
            row["val_accuracy"] = entry.metrics["val_accuracy"]
        per_checkpoint.append(row)
        if is_chosen:
            best_outcome = outcome
    assert best_outcome is not None  # The best entry is always among the kept ones.
    return chosen, best_outcome, per_checkpoint


def checkpoint_metrics(
    config: PipelineConfig,
    data_dir: str | Path,
    manifest: Manifest,
    checkpoint_dir: Path,
    chosen: CheckpointEntry,
    outcome: dict[str, Any],
    labels: np.ndarray,
) -> dict[str, Any]:
    """metrics.json but its `per_checkpoint` rows: the chosen checkpoint on the whole test split and its slices.

    Beside the test accuracy: on the test images with no near-duplicate in the training batches (the
    data stage lists them), and on the `new_data` slice (the snapshot's added validation images).
    """
    probabilities = outcome["probabilities"]
    matrix = confusion_matrix(labels, probabilities.argmax(axis=1), len(manifest.class_names))
    # Test images without a near-duplicate in the training data: what the model does on unseen pictures.
    unseen = np.ones(len(labels), bool)
    unseen[near_duplicate_test_images(data_dir, manifest)] = False
    deduplicated = score(probabilities[unseen], labels[unseen]) if unseen.any() else None
    new_data = _new_data_score(data_dir, manifest, checkpoint_dir, chosen, config.evaluate.batch_size)
    return {
        "epoch": chosen.epoch,
        "checkpoint": chosen.model_path,
        "model": config.train.model,
        "num_examples": int(len(labels)),
        "correct": outcome["correct"],
        "test_accuracy": outcome["accuracy"],
        "test_loss": outcome["loss"],
        "flip_tta_accuracy": outcome.get("flip_tta_accuracy"),
        "tta_accuracy": outcome.get("tta_accuracy"),
        "test_accuracy_deduplicated": deduplicated["accuracy"] if deduplicated else None,
        "deduplicated_examples": int(unseen.sum()),
        "new_data_accuracy": new_data["accuracy"] if new_data else None,
        "new_data_examples": new_data["examples"] if new_data else 0,
        "new_data_trained_on": config.train.use_all_training_data,  # Then the slice was seen in training.
        "class_names": list(manifest.class_names),
        "per_class": per_class_metrics(matrix, manifest.class_names),
        "confusion_matrix": matrix.tolist(),
    }


def write_evaluation_files(
    output_dir: Path,
    settings: EvaluateConfig,
    manifest: Manifest,
    images: np.ndarray,
    labels: np.ndarray,
    outcome: dict[str, Any],
    metrics: dict[str, Any],
) -> dict[str, str]:
    """metrics.json, predictions.parquet and the two figures in `output_dir`; their paths, named as in the result."""
    predictions = outcome["probabilities"].argmax(axis=1)
    metrics_path = atomic_write_json(output_dir / METRICS_NAME, metrics)
    table = predictions_table_bytes(labels, outcome["probabilities"], outcome["flip_probabilities"])
    predictions_path = atomic_write_bytes(output_dir / PREDICTIONS_NAME, table)
    title = f"Test confusion matrix (epoch {metrics['epoch']})"
    matrix = np.asarray(metrics["confusion_matrix"])
    confusion_png = plots.confusion_matrix_png(matrix, manifest.class_names, title=title)
    confusion_path = atomic_write_bytes(output_dir / CONFUSION_MATRIX_NAME, confusion_png)
    wrong = np.flatnonzero(predictions != labels)[: settings.misclassified_examples]
    grid = plots.misclassified_grid_png(images[wrong], labels[wrong], predictions[wrong], manifest.class_names)
    misclassified_path = atomic_write_bytes(output_dir / MISCLASSIFIED_NAME, grid)
    return {
        "metrics_path": str(metrics_path),
        "predictions_path": str(predictions_path),
        "confusion_matrix_plot": str(confusion_path),
        "misclassified_plot": str(misclassified_path),
    }


def _new_data_score(
    data_dir: str | Path, manifest: Manifest, checkpoint_dir: Path, entry: CheckpointEntry, batch_size: int
) -> dict[str, Any] | None:
    """Accuracy of the chosen checkpoint on the `new_data` slice, or None when the snapshot has no such images."""
    examples = slice_examples(data_dir, manifest, NEW_DATA_SLICE)
    if examples is None:
        return None
    images, labels = examples
    outcome = evaluate_checkpoint(checkpoint_dir, entry, images, labels, batch_size=batch_size, flip_tta=False)
    return {"accuracy": outcome["accuracy"], "examples": int(len(labels))}


def find_evaluation(output_dir: str | Path, key: str) -> EvaluationResult | None:
    """The stored evaluation in `output_dir` made under `key` whose files are all in place, else None."""
    path = Path(output_dir) / RESULT_NAME
    if not path.is_file():
        return None
    result = EvaluationResult.model_validate({**read_json(path), "reused": True})
    files = (result.metrics_path, result.predictions_path, result.confusion_matrix_plot, result.misclassified_plot)
    files += (result.trust_path,) if result.trust_path else ()
    if result.key != key or not all(Path(file).is_file() for file in files):
        return None
    return result
