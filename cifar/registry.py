"""The register stage: log the exported SavedModel to MLflow, register it, and judge it against the champion.

The registered model is the pyfunc of `cifar/serving_model.py` (a model from code) around the verified
SavedModel; the gate (`cifar.comparison`) records its decision on every version, and every move of the
champion alias goes into the `champion_history` tag (docs/ARCHITECTURE.md, "Registry, gate and continuous
training"). The registry needs a database-backed store.
"""

from __future__ import annotations

import getpass
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from cifar import failpoints, locks, trust
from cifar.calibration import expected_calibration_error
from cifar.champion import ACCURACY_TAG, CHAMPION_ALIAS, TrainedWith, find_champion
from cifar.comparison import Comparison, add_trust_evidence, compare
from cifar.compat import raw_input_signature
from cifar.config import PipelineConfig
from cifar.data.drift import Profile, image_features
from cifar.data.manifest import IMAGE_SHAPE, NEW_DATA_SLICE, load_manifest
from cifar.io import atomic_write_text
from cifar.model_card import CARD_DIR, CardInputs, card_html, card_markdown
from cifar.model_card import provenance as card_provenance
from cifar.model_card import robustness as card_robustness
from cifar.monitoring import REFERENCE_TAG, MonitoringReference, answers_summary
from cifar.results import EvaluationMetrics, EvaluationResult, ExportResult, PromotionResult
from cifar.reuse import registration_key
from cifar.tracking import ensure_experiment, finite_metrics, mlflow_client, resolve_tracking_uri, use_run

EXPORT_KEY_TAG = "export_key"  # The export a version was registered from: one version per export.
DECISION_TAG = "promotion"  # The gate's decision (a PromotionResult as JSON), set on a version once taken.
HISTORY_TAG = "champion_history"  # On the registered model: every move of the alias, oldest first (JSON).
HISTORY_LENGTH = 100  # Moves kept in the history.
MODEL_ARTIFACT_NAME = "model"  # The logged model's name within the run.
COMPARISON_ARTIFACT = "promotion/comparison.json"
MODEL_CODE = Path(__file__).resolve().parent / "serving_model.py"
SCORING_BATCH = 1000  # Images per predict call when the gate scores a model.

__all__ = ["CHAMPION_ALIAS", "register_and_promote"]


def __getattr__(name: str):
    """`cifar.registry.SavedModelClassifier`, which versions pickled before models from code name, found when
    asked for: the serving model's module imports MLflow, which every process importing the flows would
    otherwise pay for at start-up, also those that never track (a dry run, `prefect deploy` loading the flows)."""
    if name == "SavedModelClassifier":
        from cifar.serving_model import SavedModelClassifier

        return SavedModelClassifier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pip_requirements() -> list[str]:
    """Pinned requirements of the pyfunc, given explicitly so MLflow does not load the model to infer them."""
    return [f"{name}=={metadata.version(name)}" for name in ("mlflow", "tensorflow", "numpy")]


def log_pyfunc_model(export_result: ExportResult, input_example: np.ndarray):
    """Logs the SavedModel as a pyfunc from code, with signature and input example; returns MLflow's ModelInfo."""
    import mlflow
    from mlflow.models import infer_signature

    from cifar.serving_model import SAVED_MODEL_ARTIFACT, SavedModelClassifier

    example_outputs = SavedModelClassifier().load(export_result.export_dir).predict(None, input_example)
    # uint8 [-1, 32, 32, 3] in, the three outputs out; marked so the server passes JSON uncast to validate_images.
    signature = raw_input_signature(infer_signature(input_example, example_outputs))
    return mlflow.pyfunc.log_model(
        name=MODEL_ARTIFACT_NAME,
        python_model=str(MODEL_CODE),
        artifacts={SAVED_MODEL_ARTIFACT: export_result.export_dir},
        signature=signature,
        input_example=input_example,
        pip_requirements=pip_requirements(),
        metadata={"export_version": export_result.version, "epoch": export_result.epoch},
    )


MODEL_DESCRIPTION = (
    "CIFAR-10 classifier. Input: uint8 images [batch, 32, 32, 3], integers 0-255 (JSON `inputs`). "
    "Output: class ids, class names and probabilities. The `champion` alias is the served version; "
    "the promotion gate moves it (champion against challenger on the same images), or a person with "
    "flows/promote.py, recorded in the tag champion_history."
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
    data_dir: str | Path,
    *,
    mlflow_run_id: str | None = None,
    tracking_uri: str | None = None,
    input_example: np.ndarray | None = None,
    trained_with: TrainedWith | None = None,
    evaluation: EvaluationResult | None = None,
) -> PromotionResult:
    """Logs and registers the exported model, then judges it against the champion on `data_dir`'s test images.

    With the `evaluation` of the export's checkpoint, the version also gets its model card (cifar.model_card).

    An export registered before (same `export_key` tag) is not registered again: its recorded
    decision is returned, or taken now if the earlier attempt died before taking it. Registrations
    of one export root take turns (a lock beside it), so two runs never register one export twice.
    """
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
            mlflow_run_id = _registration_run(client, tracking_uri, workdir, config)
        with use_run(tracking_uri, mlflow_run_id):
            if version is None:
                model_info = log_pyfunc_model(export_result, _input_example(input_example))
                if not register:
                    return _not_registered(key, export_result, model_info.model_uri)
                number = register_version(client, model_name, model_info, _version_tags(export_result, trained_with))
                failpoints.reached("register.registered")
                model_uri = model_info.model_uri
            else:  # Registered by an attempt that died before the gate decided.
                number, model_uri = int(version.version), version.source
            result, judgement = _decide(client, tracking_uri, config, key, number, model_uri, data_dir, evaluation)
            if evaluation is not None:
                card = write_model_card(
                    client, config, export_result, data_dir, evaluation, result, mlflow_run_id, trained_with, judgement
                )
                result = _with_model_card(client, model_name, result, card)
    return result


def _registration_run(client, tracking_uri: str, workdir: Path, config: PipelineConfig) -> str:
    """A run of its own for a registration called without the pipeline's run."""
    experiment_id = ensure_experiment(tracking_uri, workdir, config.tracking.experiment)
    return client.create_run(experiment_id, run_name=f"register-{config.export.model_name}").info.run_id


def _not_registered(key: str, export_result: ExportResult, model_uri: str) -> PromotionResult:
    """The result when `export.register_model` is off: the model is logged to the run, not registered."""
    result = PromotionResult(
        key=key,
        registered_model_version=None,
        champion=False,
        test_accuracy=export_result.verified_accuracy,
        champion_accuracy_before=None,
        model_uri=model_uri,
        reason="registration disabled (export.register_model is false)",
    )
    _log_decision(result)
    return result


def _version_tags(export_result: ExportResult, trained_with: TrainedWith | None) -> dict[str, str]:
    """The tags a version is created with: the export it comes from (one version per export) and what made it."""
    return {
        EXPORT_KEY_TAG: export_result.key,
        "export_version": str(export_result.version),
        "export_dir": export_result.export_dir,
        "epoch": str(export_result.epoch),
        **(trained_with.tags() if trained_with is not None else {}),
    }


def _decide(
    client,
    tracking_uri: str,
    config: PipelineConfig,
    key: str,
    version: int,
    model_uri: str,
    data_dir: str | Path,
    evaluation: EvaluationResult | None,
) -> tuple[PromotionResult, Judgement]:
    """The gate on a registered version: judged against the champion, its monitoring reference and decision recorded."""
    judgement = judge(client, tracking_uri, config, version, data_dir, evaluation)
    reference = judgement.reference.model_dump_json()
    client.set_model_version_tag(config.export.model_name, str(version), REFERENCE_TAG, reference)
    return _record(client, config, key, version, model_uri, judgement.comparison), judgement


def _with_model_card(client, model_name: str, result: PromotionResult, card: Path) -> PromotionResult:
    """The decision naming the version's model card, recorded again on the version."""
    result = result.model_copy(update={"model_card": str(card)})
    version = str(result.registered_model_version)
    client.set_model_version_tag(model_name, version, DECISION_TAG, result.model_dump_json(exclude={"reused"}))
    return result


def write_model_card(
    client,
    config: PipelineConfig,
    export_result: ExportResult,
    data_dir: str | Path,
    evaluation: EvaluationResult,
    result: PromotionResult,
    run_id: str | None,
    trained_with: TrainedWith | None,
    judgement: Judgement,
) -> Path:
    """The version's model card: written under WORKDIR/model_cards/, logged to its run, linked from its description.

    Its figures come from the model the gate judged (`judgement`: the registered version, loaded once)."""
    import mlflow

    from cifar.tracking import git_commit

    model_name, version = config.export.model_name, int(result.registered_model_version)
    images, labels, predictions = judgement.test_images, judgement.test_labels, judgement.test_classes

    def predict(batch: np.ndarray) -> np.ndarray:
        return judgement.challenger(batch).argmax(axis=1)

    manifest = load_manifest(data_dir)
    robust = config.export.card_robustness_examples  # The first N test images (None: all).
    inputs = CardInputs(
        model_name=model_name,
        version=version,
        run_id=run_id,
        champion=result.champion,
        config=config,
        trained_with=trained_with or TrainedWith(),
        git_commit=git_commit(),
        manifest=manifest,
        evaluation=EvaluationMetrics.read(evaluation.metrics_path),
        comparison=Comparison.model_validate(result.comparison),
        robustness=card_robustness(predict, images[:robust], labels[:robust]),
        robustness_examples=len(labels[:robust]),
        robustness_clean_accuracy=float(np.mean(predictions[:robust] == labels[:robust])),
        provenance=card_provenance(manifest, predictions, labels),
        trust=trust.load_report(evaluation.trust_path),
    )
    markdown_text = card_markdown(inputs)
    directory = Path(export_result.export_dir).resolve().parents[2] / CARD_DIR / model_name / f"v{version}"
    atomic_write_text(directory / "model_card.md", markdown_text)
    atomic_write_text(directory / "model_card.html", card_html(markdown_text, f"{model_name} v{version}"))
    mlflow.log_artifacts(str(directory), artifact_path="model_card")
    link = f"runs:/{run_id}/model_card/model_card.html" if run_id else str(directory / "model_card.html")
    described = client.get_model_version(model_name, str(version)).description or ""
    client.update_model_version(model_name, str(version), description=f"{described} Model card: {link}")
    return directory / "model_card.md"


def _input_example(input_example: np.ndarray | None) -> np.ndarray:
    if input_example is None:
        return np.zeros((1, *IMAGE_SHAPE), dtype=np.uint8)
    return np.asarray(input_example, dtype=np.uint8)


Scorer = Callable[[np.ndarray], np.ndarray]  # uint8 images (N, 32, 32, 3) -> probabilities (N, 10).


def registered_scorer(model_uri: str) -> Scorer:
    """A registered model loaded once as serving loads it (its pyfunc); it scores images in batches. Its classes
    are the argmax of these probabilities, as serving answers them."""
    import mlflow

    model = mlflow.pyfunc.load_model(model_uri)

    def probabilities(images: np.ndarray) -> np.ndarray:
        batches = [
            np.asarray(model.predict(images[start : start + SCORING_BATCH])["probabilities"])
            for start in range(0, len(images), SCORING_BATCH)
        ]
        return np.concatenate(batches) if batches else np.zeros((0, 10), np.float32)

    return probabilities


@dataclass(frozen=True)
class Judgement:
    """The gate's findings on a challenger, and what its model card reuses rather than computing again."""

    comparison: Comparison
    reference: MonitoringReference  # The challenger's monitoring reference.
    challenger: Scorer  # The registered challenger, loaded once.
    test_images: np.ndarray
    test_labels: np.ndarray
    test_classes: np.ndarray  # The challenger's class ids on the test images.


def judge(
    client,
    tracking_uri: str,
    config: PipelineConfig,
    version: int,
    data_dir: str | Path,
    evaluation: EvaluationResult | None = None,
) -> Judgement:
    """The challenger `version` against the current champion, on the test split and new_data slice of `data_dir`,
    and the challenger's monitoring reference (its training images, its answers on the test split). Each model
    is loaded once (a load is seconds: fetched from the artifact store, then TensorFlow's).

    Calibration (ECE of the served probabilities) and robustness (the challenger's `evaluation` measured it;
    the champion scores the same corrupted images) are weighed too (cifar.comparison.add_trust_evidence)."""
    from cifar.compat import mlflow_tracking_uri
    from cifar.evaluate import load_split, slice_examples

    model_name = config.export.model_name
    manifest = load_manifest(data_dir)
    images, labels = load_split(data_dir, "test")
    new_data = slice_examples(data_dir, manifest, NEW_DATA_SLICE)
    champion = find_champion(tracking_uri, model_name)
    if champion is not None and champion.version == version:  # An earlier attempt moved the alias, then died.
        champion = _previous_champion(client, model_name, version)
    with mlflow_tracking_uri(tracking_uri):  # models:/ URIs resolve against this registry.
        score_challenger = registered_scorer(f"models:/{model_name}/{version}")
        score_champion = registered_scorer(f"models:/{model_name}/{champion.version}") if champion is not None else None
    probabilities = score_challenger(images)
    challenger = (version, probabilities.argmax(axis=1))
    champion_scores = champion_probabilities = None
    if score_champion is not None:
        champion_probabilities = score_champion(images)
        champion_scores = (champion.version, champion_probabilities.argmax(axis=1))
    slice_scores = None
    if new_data is not None:
        slice_images, slice_labels = new_data
        champion_slice = score_champion(slice_images).argmax(axis=1) if score_champion else None
        slice_scores = (slice_labels, score_challenger(slice_images).argmax(axis=1), champion_slice)
    comparison = compare(
        model_name, manifest.class_names, labels, challenger, champion_scores, config.export, new_data=slice_scores
    )
    eces = (
        expected_calibration_error(probabilities, labels),
        expected_calibration_error(champion_probabilities, labels) if champion_probabilities is not None else None,
    )
    report = trust.load_report(evaluation.trust_path) if evaluation is not None else None
    corrupted = trust.paired_corruption_shares(report, images, labels, score_champion, data_dir)
    comparison = add_trust_evidence(comparison, eces, corrupted, config.export)
    reference = monitoring_reference(data_dir, probabilities, config.monitor.confidence_threshold)
    return Judgement(comparison, reference, score_challenger, images, labels, challenger[1])


def monitoring_reference(data_dir: str | Path, test_probabilities: np.ndarray, threshold: float) -> MonitoringReference:
    """The reference batch monitoring compares with: the training split's images, the answers on the test split."""
    from cifar.evaluate import load_split

    training_images, _ = load_split(data_dir, "train")
    predictions, low = answers_summary(test_probabilities, threshold)
    return MonitoringReference(
        images=Profile.of(image_features(training_images)),
        predictions=predictions,
        low_confidence_share=low,
        confidence_threshold=threshold,
        test_examples=len(test_probabilities),
    )


def _previous_champion(client, model_name: str, version: int):
    """The champion before `version` took the alias (from the history), for a decision taken again."""
    from cifar.champion import Champion

    earlier = [move for move in alias_moves(client, model_name) if move["version"] != version]
    if not earlier:
        return None
    return Champion.of_version(model_name, client.get_model_version(model_name, str(earlier[-1]["version"])))


def _record(client, config: PipelineConfig, key: str, version: int, model_uri: str, comparison: Comparison):
    """Moves the alias if the comparison says so, then records the decision and the comparison on the version."""
    import mlflow

    model_name = config.export.model_name
    # With approval required the gate's pass is a proposal: a person moves the alias (cifar.approval).
    waiting = comparison.promote and config.promotion.approval == "required"
    promote = comparison.promote and not waiting
    if promote:
        client.set_registered_model_alias(model_name, CHAMPION_ALIAS, str(version))
        append_history(client, model_name, version, how="gate", reason=comparison.reason)
    champion = comparison.champion
    reason = f"{comparison.reason}; awaits a person's approval" if waiting else comparison.reason
    result = PromotionResult(
        key=key,
        registered_model_version=version,
        champion=promote,
        awaiting_approval=waiting,
        test_accuracy=comparison.challenger.accuracy,
        champion_accuracy_before=champion.accuracy if champion else None,
        champion_version_before=champion.version if champion else None,
        model_uri=model_uri,
        reason=reason,
        rule=comparison.rule,
        p_value=comparison.p_value,
        comparison_artifact=COMPARISON_ARTIFACT,
        comparison=comparison.model_dump(mode="json"),
    )
    mlflow.log_dict(comparison.model_dump(mode="json"), COMPARISON_ARTIFACT)
    client.set_model_version_tag(model_name, str(version), ACCURACY_TAG, repr(comparison.challenger.accuracy))
    client.set_model_version_tag(model_name, str(version), DECISION_TAG, result.model_dump_json(exclude={"reused"}))
    for criterion, criterion_verdict in comparison.criteria.items():  # Robustness and calibration, decisive or not.
        client.set_model_version_tag(model_name, str(version), f"gate.{criterion}", criterion_verdict[:5000])
    verdict = "champion" if promote else ("passed the gate" if waiting else "not promoted")
    description = (
        f"Test accuracy {100 * comparison.challenger.accuracy:.2f} %, {verdict} ({comparison.rule}): "
        f"{reason}. Comparison: run artifact {COMPARISON_ARTIFACT}."
    )
    client.update_model_version(model_name, str(version), description=description)
    _log_decision(result)
    return result


def _log_decision(result: PromotionResult) -> None:
    """The decision and both accuracies on the active run (tags and metrics: a run may register twice)."""
    import mlflow

    tags: dict[str, Any] = {
        "promotion.champion": str(result.champion).lower(),
        "promotion.reason": result.reason[:5000],
    }
    if result.registered_model_version is not None:
        tags["registry.model_version"] = str(result.registered_model_version)
    if result.champion_version_before is not None:
        tags["promotion.champion_version_before"] = str(result.champion_version_before)
    if result.rule:
        tags["promotion.rule"] = result.rule
    mlflow.set_tags(tags)
    metrics = {"promotion_test_accuracy": result.test_accuracy, "promotion_champion": float(result.champion)}
    if result.champion_accuracy_before is not None:
        metrics["promotion_champion_accuracy_before"] = result.champion_accuracy_before
    if result.p_value is not None:
        metrics["promotion_p_value"] = result.p_value
    mlflow.log_metrics(finite_metrics(metrics))


# The champion's history: every move of the alias, for audits and rollbacks.


def champion_history(client, model_name: str) -> list[dict[str, Any]]:
    """Every move of the champion alias and every person's decision, oldest first: version, at, by, how (gate,
    approval, override, rollback; rejected and expired, which did not move it: `moved` false), reason."""
    try:
        model = client.get_registered_model(model_name)
    except Exception:  # No such model yet.
        return []
    return json.loads(model.tags.get(HISTORY_TAG, "[]"))


def alias_moves(client, model_name: str) -> list[dict[str, Any]]:
    """The history's entries that moved the alias (not the rejections), oldest first."""
    return [move for move in champion_history(client, model_name) if move.get("moved", True)]


def append_history(
    client, model_name: str, version: int, *, how: str, reason: str, by: str | None = None, moved: bool = True
) -> None:
    """Records one move of the alias (or a decision not to move it) on the registered model; the last
    HISTORY_LENGTH entries are kept."""
    move = {
        "version": version,
        "at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "by": by or _user(),
        "how": how,
        "reason": reason[:500],
        **({} if moved else {"moved": False}),
    }
    history = [*champion_history(client, model_name), move][-HISTORY_LENGTH:]
    client.set_registered_model_tag(model_name, HISTORY_TAG, json.dumps(history))


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # No name for this uid (a container).
        return "unknown"


# Overrides by a person: move the alias to a version the gate refused, or back to the previous champion.

OVERRIDE_TAG = "override"  # On a version the alias was moved to by hand: who, when, why (JSON).


def promote_by_hand(
    tracking_uri: str,
    model_name: str,
    version: int | None,
    reason: str,
    *,
    rollback: bool = False,
    by: str | None = None,
) -> dict[str, Any]:
    """Moves the champion alias to `version` (or, with `rollback`, to the champion before the current one).

    Records who, when and why on the version (tag `override`) and in the champion history; returns
    that record. The gate's own decision on the version stays as it was.
    """
    if not reason.strip():
        raise ValueError("a reason is required: it is recorded with the override for whoever reads the registry")
    client = mlflow_client(tracking_uri)
    current = find_champion(tracking_uri, model_name)
    if rollback:
        version = _rollback_target(client, model_name, current.version if current else None)
    elif version is None:
        raise ValueError("give the version to promote, or ask for a rollback")
    target = client.get_model_version(model_name, str(version))  # Raises for an unknown version.
    how = "rollback" if rollback else "override"
    record = {
        "how": how,
        "version": int(target.version),
        "previous_champion": current.version if current else None,
        "by": by or _user(),
        "at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "reason": reason.strip()[:500],
    }
    client.set_registered_model_alias(model_name, CHAMPION_ALIAS, str(version))
    client.set_model_version_tag(model_name, str(version), OVERRIDE_TAG, json.dumps(record))
    append_history(client, model_name, int(version), how=how, reason=record["reason"], by=record["by"])
    return record


def _rollback_target(client, model_name: str, current: int | None) -> int:
    """The version that held the alias before the current champion got it (from the history)."""
    history = alias_moves(client, model_name)
    made_current = max((index for index, move in enumerate(history) if move["version"] == current), default=None)
    earlier = [move for move in history[: made_current or 0] if move["version"] != current]
    if current is None or not earlier:
        raise ValueError(f"no earlier champion of {model_name} to roll back to (history: {len(history)} moves)")
    return int(earlier[-1]["version"])
