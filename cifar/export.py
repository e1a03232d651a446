"""The export stage: a verified TensorFlow SavedModel in the TF-Serving layout.

    WORKDIR/export/<model_name>/<version>/   saved_model.pb, variables/, assets.extra/export.json

Written into a hidden temp directory, reloaded and checked there, then renamed to the next version
number (`cifar.workdir`), so a failed export never leaves a half version; export.json records the key.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tensorflow as tf

from cifar import compat, failpoints, locks
from cifar.checkpoints import load_eval_model, load_index
from cifar.config import PipelineConfig
from cifar.data.manifest import IMAGE_SHAPE, load_manifest
from cifar.evaluate import load_split, model_input_size
from cifar.input_pipeline import center_crop
from cifar.results import EvaluationResult, ExportResult
from cifar.reuse import export_key
from cifar.tracking import resolve_tracking_uri, use_run
from cifar.workdir import (
    EXPORT_METADATA_PATH,
    EXPORT_PARTIAL_PREFIX,
    EXPORT_PARTIAL_SUFFIX,
    EXPORT_PROBE_PATH,
    PROBE_EXAMPLES,
    export_root,
    find_export,
    publish_version,
    remove_partials,
)

# The signatures (normalization and, for the tutorial CNN, the centre crop are inside the graph):
#   serving_default  images: uint8 [batch, 32, 32, 3] -> class_ids int64 [batch], class_names string [batch],
#                                                         probabilities float32 [batch, 10]
#   serving_bytes    image_bytes: string [batch] of encoded 32x32 PNG/JPEG images -> the same outputs
SERVING_SIGNATURE = "serving_default"
BYTES_SIGNATURE = "serving_bytes"
INPUT_NAME = "images"
BYTES_INPUT_NAME = "image_bytes"
OUTPUT_NAMES = ("class_ids", "class_names", "probabilities", "logits")


class ExportVerificationError(RuntimeError):
    """The reloaded SavedModel does not reproduce the evaluated accuracy, or the CLI cannot describe it."""


class ServingModule(tf.Module):
    """Wraps a Keras classifier with serving signatures that take raw uint8 images or encoded bytes."""

    def __init__(self, model, class_names: Sequence[str], temperature: float = 1.0):
        super().__init__(name="cifar_serving")
        self.model = model
        self.input_size = model_input_size(model)
        self.class_names = tf.constant(list(class_names), dtype=tf.string)
        # The evaluation's temperature (fitted on the validation split): served probabilities are calibrated.
        self.temperature = tf.constant(float(temperature), dtype=tf.float32)

    def classify(self, images: tf.Tensor) -> dict[str, tf.Tensor]:
        """Class ids, names, calibrated probabilities and the raw logits of uint8 images (B, 32, 32, 3)."""
        pixels = center_crop(tf.cast(images, tf.float32), self.input_size)  # (B, S, S, 3)
        logits = tf.cast(self.model(pixels, training=False), tf.float32)  # (B, 10)
        # The class is the argmax of the logits, exactly as evaluation decides it (a temperature changes no argmax).
        class_ids = tf.argmax(logits, axis=1, output_type=tf.int64)
        return {
            "class_ids": class_ids,
            "class_names": tf.gather(self.class_names, class_ids),
            "probabilities": tf.nn.softmax(logits / self.temperature, axis=1),
            "logits": logits,
        }

    @tf.function(input_signature=[tf.TensorSpec([None, *IMAGE_SHAPE], tf.uint8, name=INPUT_NAME)])
    def serve(self, images: tf.Tensor) -> dict[str, tf.Tensor]:
        return self.classify(images)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name=BYTES_INPUT_NAME)])
    def serve_bytes(self, image_bytes: tf.Tensor) -> dict[str, tf.Tensor]:
        def decode(encoded: tf.Tensor) -> tf.Tensor:
            image = tf.io.decode_image(encoded, channels=3, dtype=tf.uint8, expand_animations=False)
            return tf.ensure_shape(image, IMAGE_SHAPE)

        images = tf.map_fn(decode, image_bytes, fn_output_signature=tf.TensorSpec(IMAGE_SHAPE, tf.uint8))
        return self.classify(images)


def serving_outputs(export_dir: str | Path, images: np.ndarray, batch_size: int) -> dict[str, np.ndarray]:
    """Runs the reloaded SavedModel's serving_default over uint8 images (N, 32, 32, 3) in batches."""
    serve = tf.saved_model.load(str(export_dir)).signatures[SERVING_SIGNATURE]
    batches: dict[str, list[np.ndarray]] = {name: [] for name in OUTPUT_NAMES}
    for start in range(0, len(images), batch_size):
        outputs = serve(**{INPUT_NAME: tf.constant(images[start : start + batch_size], dtype=tf.uint8)})
        for name in OUTPUT_NAMES:
            batches[name].append(outputs[name].numpy())
    return {name: np.concatenate(values) for name, values in batches.items() if values}


def expected_correct_count(expected_accuracy: float, num_examples: int) -> int:
    """The number of correct examples an accuracy on `num_examples` stands for; rejects impossible values."""
    count = expected_accuracy * num_examples
    if not 0 <= expected_accuracy <= 1 or abs(count - round(count)) > 1e-6 * max(1, num_examples):
        raise ValueError(f"expected_accuracy {expected_accuracy!r} is not an accuracy over {num_examples} examples")
    return round(count)


def verify_export(
    export_dir: Path, images: np.ndarray, labels: np.ndarray, *, expected_accuracy: float, batch_size: int
) -> tuple[int, str]:
    """Checks the reloaded model reproduces the accuracy exactly and the CLI describes it: (correct, CLI text).

    Also writes the probe (EXPORT_PROBE_PATH): the first test images and the probabilities just verified."""
    expected = expected_correct_count(expected_accuracy, len(labels))
    outputs = serving_outputs(export_dir, images, batch_size)
    write_probe(export_dir, images[:PROBE_EXAMPLES], outputs["probabilities"][:PROBE_EXAMPLES])
    correct = int(np.sum(outputs["class_ids"] == labels))
    if correct != expected:
        raise ExportVerificationError(
            f"the reloaded SavedModel classifies {correct}/{len(labels)} test images correctly, "
            f"the evaluated checkpoint {expected}/{len(labels)}"
        )
    description = compat.saved_model_description(str(export_dir))  # saved_model_cli show --all
    for needed in (f"signature_def['{SERVING_SIGNATURE}']", f"inputs['{INPUT_NAME}']"):
        if needed not in description:
            raise ExportVerificationError(f"saved_model_cli does not describe {needed}:\n{description[-2000:]}")
    return correct, description


def write_probe(export_dir: Path, images: np.ndarray, probabilities: np.ndarray) -> None:
    path = Path(export_dir) / EXPORT_PROBE_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as file:
        np.savez(file, images=images.astype(np.uint8), probabilities=probabilities.astype(np.float32))


def export_model(
    config: PipelineConfig,
    data_dir: str | Path,
    checkpoint_dir: str | Path,
    workdir: str | Path,
    evaluation: EvaluationResult,
    *,
    refresh: bool = False,
    mlflow_run_id: str | None = None,
    tracking_uri: str | None = None,
) -> ExportResult:
    """Exports the evaluated checkpoint (evaluation weights) as the next verified SavedModel version.

    The version an earlier export of the same key published is returned instead, unless `refresh`
    (also after a crash between export and registration): versions are never overwritten.
    """
    root = export_root(Path(workdir), config.export.model_name)
    key = export_key(config, evaluation.key)
    root.mkdir(parents=True, exist_ok=True)
    # Exports of one model take turns: a second export of the same key finds the first one's version.
    with locks.exclusive(locks.lock_path(root), f"exports of {config.export.model_name}"):
        finished = None if refresh else find_export(root, key)
        if finished is not None:
            return finished
        remove_partials(root)  # Under the lock, every temp directory there belongs to an export that died.
        result, description = _export(config, data_dir, Path(checkpoint_dir), root, evaluation, key)
    if mlflow_run_id:
        tracking_uri = tracking_uri or resolve_tracking_uri(config.tracking, workdir)
        log_to_mlflow(tracking_uri, mlflow_run_id, result, description)
    return result


def _export(
    config: PipelineConfig,
    data_dir: str | Path,
    checkpoint_dir: Path,
    root: Path,
    evaluation: EvaluationResult,
    key: str,
) -> tuple[ExportResult, str]:
    """Writes, verifies and publishes the next version; returns its result and the CLI's description."""
    try:
        entry = load_index(checkpoint_dir).entry(evaluation.epoch)
    except KeyError as error:
        raise ValueError(f"no checkpoint of epoch {evaluation.epoch} in {checkpoint_dir}") from error
    manifest = load_manifest(data_dir)
    images, labels = load_split(data_dir, "test")
    temperature = evaluation.temperature or 1.0  # None: nothing was held out to fit one on.
    module = ServingModule(load_eval_model(checkpoint_dir, entry), manifest.class_names, temperature)
    signatures = {SERVING_SIGNATURE: module.serve, BYTES_SIGNATURE: module.serve_bytes}
    temp_dir = Path(tempfile.mkdtemp(prefix=EXPORT_PARTIAL_PREFIX, suffix=EXPORT_PARTIAL_SUFFIX, dir=root))
    try:
        tf.saved_model.save(module, str(temp_dir), signatures=signatures)
        correct, description = verify_export(
            temp_dir, images, labels, expected_accuracy=evaluation.test_accuracy, batch_size=config.evaluate.batch_size
        )
        result = ExportResult(
            key=key,
            export_dir="",
            version=0,
            verified_accuracy=correct / len(labels),
            epoch=evaluation.epoch,
            signatures=sorted(signatures),
            num_examples=len(labels),
            correct=correct,
            temperature=temperature,
        )
        metadata = {
            "key": key,
            "checkpoint": entry.model_path,
            "model": config.train.model,
            "class_names": manifest.class_names,
            "result": result.model_dump(exclude={"reused"}),
        }
        (temp_dir / EXPORT_METADATA_PATH).parent.mkdir(parents=True, exist_ok=True)
        (temp_dir / EXPORT_METADATA_PATH).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
        failpoints.reached("export.saved")
        version, final = publish_version(temp_dir, root)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return result.model_copy(update={"export_dir": str(final), "version": version}), description


def log_to_mlflow(tracking_uri: str, run_id: str, result: ExportResult, description: str) -> None:
    """The version, its directory and its verified accuracy, plus the CLI's description of the signatures."""
    import mlflow

    with use_run(tracking_uri, run_id):
        # Tags, not params: a re-export in the same run publishes a new version and must be able to say so.
        mlflow.set_tags(
            {"export.version": str(result.version), "export.dir": result.export_dir, "export.epoch": str(result.epoch)}
        )
        mlflow.log_metric("export_verified_accuracy", result.verified_accuracy, step=result.epoch)
        mlflow.log_text(description, f"export/{result.version}/saved_model_cli.txt")
