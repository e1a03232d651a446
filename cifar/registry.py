"""The register stage: log the exported SavedModel to MLflow, register it, and gate the `champion` alias.

The logged model is an MLflow pyfunc that wraps the verified SavedModel directory as an artifact and
calls its `serving_default` signature, so `mlflow models serve -m models:/cifar10@champion` answers
with exactly what TF Serving would: class ids, class names and probabilities. Its input contract
(uint8 images [batch, 32, 32, 3], JSON integers 0..255) is enforced by `cifar.serving_contract`:
anything else is refused with HTTP 400 and the contract in the message, never cast.

Promotion gate (the TFX "blessing"): a new version takes the `champion` alias only if its test
accuracy is at least `export.min_accuracy` and at least the current champion's accuracy minus
`export.tolerance`. Each version carries its accuracy as the tag `test_accuracy` for later gates.
The registry needs a database-backed store (SQLite or a server), not a plain `file:` store.

Registration is idempotent per export: every version is created with the tag `export_key` (the
export stage's key, one per export directory), and the gate's decision is recorded on the version
once taken. Registering the same export again returns the recorded decision; a version registered
by an attempt that died before deciding gets its decision now. Versions and exports stay one-to-one.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.pyfunc import PythonModel

from cifar import failpoints, locks
from cifar.champion import TrainedWith
from cifar.compat import raw_input_signature
from cifar.config import PipelineConfig
from cifar.data.manifest import IMAGE_SHAPE
from cifar.export import INPUT_NAME, SERVING_SIGNATURE
from cifar.results import ExportResult, PromotionResult
from cifar.reuse import registration_key
from cifar.serving_contract import validate_images
from cifar.tracking import ensure_experiment, finite_metrics, mlflow_client, resolve_tracking_uri, use_run

CHAMPION_ALIAS = "champion"
ACCURACY_TAG = "test_accuracy"
EXPORT_KEY_TAG = "export_key"  # The export a version was registered from: one version per export.
DECISION_TAG = "promotion"  # The gate's decision (a PromotionResult as JSON), set on a version once taken.
MODEL_ARTIFACT_NAME = "model"  # The logged model's name within the run.
SAVED_MODEL_ARTIFACT = "saved_model"  # The key of the SavedModel directory among the pyfunc's artifacts.


class SavedModelClassifier(PythonModel):
    """An MLflow pyfunc calling a SavedModel's serving_default on uint8 images (N, 32, 32, 3).

    Its input is checked by `cifar.serving_contract.validate_images`: anything but integers 0..255
    shaped [N, 32, 32, 3] is refused with the contract in the message (HTTP 400 when served).
    """

    def load_context(self, context) -> None:
        self.load(context.artifacts[SAVED_MODEL_ARTIFACT])

    def load(self, export_dir: str) -> SavedModelClassifier:
        import tensorflow as tf

        self._serve = tf.saved_model.load(export_dir).signatures[SERVING_SIGNATURE]
        return self

    def predict(self, context, model_input, params=None) -> dict[str, np.ndarray]:
        import tensorflow as tf

        images = validate_images(model_input)  # The serving contract: refuses (HTTP 400) rather than casts.
        outputs = self._serve(**{INPUT_NAME: tf.constant(images)})
        return {
            "class_ids": outputs["class_ids"].numpy().astype(np.int64),
            "class_names": np.array([name.decode("utf-8") for name in outputs["class_names"].numpy()]),
            "probabilities": outputs["probabilities"].numpy().astype(np.float32),
        }


def promotion_decision(
    test_accuracy: float,
    champion_accuracy: float | None,
    *,
    min_accuracy: float,
    tolerance: float,
    champion_version: int | None = None,
) -> tuple[bool, str]:
    """Whether a model with `test_accuracy` should become champion, and why (or why not)."""
    if test_accuracy < min_accuracy:
        return False, f"test accuracy {test_accuracy:.4f} is below export.min_accuracy {min_accuracy:.4f}"
    if champion_version is not None and champion_accuracy is None:
        return False, f"the current champion v{champion_version} has no {ACCURACY_TAG} tag to compare with; keeping it"
    if champion_accuracy is None:
        return True, f"first champion: test accuracy {test_accuracy:.4f} >= export.min_accuracy {min_accuracy:.4f}"
    floor = champion_accuracy - tolerance
    if test_accuracy < floor:
        return False, (
            f"test accuracy {test_accuracy:.4f} is below the champion's {champion_accuracy:.4f} "
            f"minus tolerance {tolerance:.4f}; keeping the champion v{champion_version}"
        )
    return True, (
        f"test accuracy {test_accuracy:.4f} >= the champion's {champion_accuracy:.4f} "
        f"minus tolerance {tolerance:.4f} (was v{champion_version})"
    )


def current_champion(client, model_name: str) -> tuple[int | None, float | None]:
    """The version holding the champion alias and its stored test accuracy (None, None when there is none)."""
    from mlflow.exceptions import MlflowException

    try:
        version = client.get_model_version_by_alias(model_name, CHAMPION_ALIAS)
    except MlflowException:  # No such registered model, or no champion yet.
        return None, None
    value = version.tags.get(ACCURACY_TAG)
    return int(version.version), (float(value) if value is not None else None)


def pip_requirements() -> list[str]:
    """Pinned requirements of the pyfunc, given explicitly so MLflow does not load the model to infer them."""
    return [f"{name}=={metadata.version(name)}" for name in ("mlflow", "tensorflow", "numpy")]


def log_pyfunc_model(export_result: ExportResult, input_example: np.ndarray):
    """Logs the SavedModel as a pyfunc with signature and input example; returns MLflow's ModelInfo."""
    import mlflow
    from mlflow.models import infer_signature

    example_outputs = SavedModelClassifier().load(export_result.export_dir).predict(None, input_example)
    # uint8 [-1, 32, 32, 3] in, the three outputs out; marked so the server passes JSON uncast to validate_images.
    signature = raw_input_signature(infer_signature(input_example, example_outputs))
    return mlflow.pyfunc.log_model(
        name=MODEL_ARTIFACT_NAME,
        python_model=SavedModelClassifier(),
        artifacts={SAVED_MODEL_ARTIFACT: export_result.export_dir},
        signature=signature,
        input_example=input_example,
        pip_requirements=pip_requirements(),
        metadata={"export_version": export_result.version, "epoch": export_result.epoch},
    )


MODEL_DESCRIPTION = (
    "CIFAR-10 classifier. Input: uint8 images [batch, 32, 32, 3], integers 0-255 (JSON `inputs`). "
    "Output: class ids, class names and probabilities. The `champion` alias is the served version; "
    "only the pipeline's promotion gate moves it."
)


def register_version(client, model_name: str, model_info, tags: dict[str, str]) -> int:
    """Registers a logged model as a new version of `model_name`, created with its tags in one request."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(model_name, description=MODEL_DESCRIPTION)
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(
        model_name, source=model_info.model_uri, run_id=model_info.run_id, model_id=model_info.model_id, tags=tags
    )
    return int(version.version)


def registered_version(client, model_name: str, export_key: str):
    """The model version registered from the export with `export_key`, or None."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name = '{model_name}'")
    except MlflowException:
        return None
    matches = [version for version in versions if version.tags.get(EXPORT_KEY_TAG) == export_key]
    return min(matches, key=lambda version: int(version.version), default=None)


def recorded_decision(version, key: str) -> PromotionResult | None:
    """The gate's decision stored on a version, or None when no attempt got that far."""
    if DECISION_TAG not in version.tags:
        return None
    return PromotionResult.model_validate_json(version.tags[DECISION_TAG]).model_copy(
        update={"key": key, "reused": True}
    )


def register_and_promote(
    config: PipelineConfig,
    export_result: ExportResult,
    test_accuracy: float,
    *,
    mlflow_run_id: str | None = None,
    tracking_uri: str | None = None,
    input_example: np.ndarray | None = None,
    trained_with: TrainedWith | None = None,
) -> PromotionResult:
    """Logs and registers the exported model, then moves `champion` to it only if it passes the gate.

    An export registered before (same `export_key` tag) is not registered again: its recorded
    decision is returned, or taken now if the earlier attempt died before taking it. Registrations
    of one export root take turns (a lock beside it), so two runs never register one export twice.
    """
    if not 0 <= test_accuracy <= 1:
        raise ValueError(f"test_accuracy must be in 0..1, got {test_accuracy}")
    workdir = Path(export_result.export_dir).resolve().parents[2]  # WORKDIR/export/<model>/<version>
    tracking_uri = tracking_uri or resolve_tracking_uri(config.tracking, workdir)
    key = registration_key(config, export_result.key, tracking_uri)
    model_name = config.export.model_name
    # The registry lives in the tracking store; never in a registry some other code set globally.
    client = mlflow_client(tracking_uri)
    lock = locks.lock_path(Path(export_result.export_dir).parent, "register")
    with locks.exclusive(lock, f"registering into {model_name}"):
        register = config.export.register_model
        version = registered_version(client, model_name, export_result.key) if register else None
        if version is not None and (decision := recorded_decision(version, key)) is not None:
            return decision
        if mlflow_run_id is None:
            experiment_id = ensure_experiment(tracking_uri, workdir, config.tracking.experiment)
            mlflow_run_id = client.create_run(experiment_id, run_name=f"register-{model_name}").info.run_id
        with use_run(tracking_uri, mlflow_run_id):
            if version is None:
                model_info = log_pyfunc_model(export_result, _input_example(input_example))
                model_uri = model_info.model_uri
            number = None  # Registration disabled: the gate has nothing to move.
            if register and version is None:
                tags = {
                    EXPORT_KEY_TAG: export_result.key,
                    ACCURACY_TAG: repr(float(test_accuracy)),
                    "export_version": str(export_result.version),
                    "export_dir": export_result.export_dir,
                    "epoch": str(export_result.epoch),
                    **(trained_with.tags() if trained_with is not None else {}),
                }
                number = register_version(client, model_name, model_info, tags)
                failpoints.reached("register.registered")
            elif register:  # Registered by an attempt that died before the gate decided.
                number, model_uri = int(version.version), version.source
            result = _gate(client, config, key, number, model_uri, test_accuracy)
            _log_decision(result)
            if number is not None:  # What the registry page shows beside the version.
                verdict = "champion" if result.champion else "not promoted"
                description = f"Test accuracy {100 * test_accuracy:.2f} %, {verdict}: {result.reason}"
                client.update_model_version(model_name, str(number), description=description)
    return result


def _input_example(input_example: np.ndarray | None) -> np.ndarray:
    if input_example is None:
        return np.zeros((1, *IMAGE_SHAPE), dtype=np.uint8)
    return np.asarray(input_example, dtype=np.uint8)


def _gate(
    client, config: PipelineConfig, key: str, version: int | None, model_uri: str, test_accuracy: float
) -> PromotionResult:
    """Applies the promotion gate to the champion alias, then records the decision on the version (if any)."""
    model_name = config.export.model_name
    champion_version, champion_accuracy = current_champion(client, model_name) if version else (None, None)
    if champion_version == version:  # An earlier attempt moved the alias, then died before recording it.
        champion_version, champion_accuracy = None, None
    gate = config.export
    promote, reason = promotion_decision(
        test_accuracy,
        champion_accuracy,
        min_accuracy=gate.min_accuracy,
        tolerance=gate.tolerance,
        champion_version=champion_version,
    )
    if version is None:
        promote, reason = False, "registration disabled (export.register_model is false)"
    elif promote:
        client.set_registered_model_alias(model_name, CHAMPION_ALIAS, str(version))
    result = PromotionResult(
        key=key,
        registered_model_version=version,
        champion=promote,
        test_accuracy=test_accuracy,
        champion_accuracy_before=champion_accuracy,
        champion_version_before=champion_version,
        model_uri=model_uri,
        reason=reason,
    )
    if version is not None:
        client.set_model_version_tag(model_name, str(version), DECISION_TAG, result.model_dump_json(exclude={"reused"}))
    return result


def _log_decision(result: PromotionResult) -> None:
    """The decision and both accuracies on the active run (tags and metrics: a run may register twice)."""
    import mlflow

    tags: dict[str, Any] = {"promotion.champion": str(result.champion).lower(), "promotion.reason": result.reason}
    if result.registered_model_version is not None:
        tags["registry.model_version"] = str(result.registered_model_version)
    if result.champion_version_before is not None:
        tags["promotion.champion_version_before"] = str(result.champion_version_before)
    mlflow.set_tags(tags)
    metrics = {"promotion_test_accuracy": result.test_accuracy, "promotion_champion": float(result.champion)}
    if result.champion_accuracy_before is not None:
        metrics["promotion_champion_accuracy_before"] = result.champion_accuracy_before
    mlflow.log_metrics(finite_metrics(metrics))
