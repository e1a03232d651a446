"""Tasks after training: evaluate on the test split, export a SavedModel version, register and gate it."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from cifar.champion import TrainedWith
from cifar.checkpoints import index_digest
from cifar.config import PipelineConfig
from cifar.evaluate import find_evaluation
from cifar.quiet import import_tensorflow
from cifar.results import DataResult, EvaluationResult, ExportResult, PromotionResult, TrainResult
from cifar.reuse import evaluation_key, export_key, registration_key
from cifar.workdir import find_export
from tasks.artifacts import publish_comparison, publish_model_card
from tasks.caching import stage_task
from tasks.events import announce_move


def logged_to(training: TrainResult) -> dict[str, str | None]:
    """Where the stages after training log: the training's MLflow run, in its store."""
    return {"mlflow_run_id": training.mlflow_run_id, "tracking_uri": training.tracking_uri}


@stage_task(
    "evaluate",
    key_fn=lambda config, dataset, training, **_: evaluation_key(
        config, dataset.key, index_digest(training.checkpoint_dir)
    ),
    is_valid=lambda result: find_evaluation(Path(result.metrics_path).parent, result.key) is not None,
)
def evaluate_model(
    config: PipelineConfig, dataset: DataResult, training: TrainResult, workdir: str, refresh: bool = False
) -> EvaluationResult:
    """Evaluates the best checkpoint (by validation accuracy) on the test split."""
    from cifar.evaluate import evaluate

    import_tensorflow()

    return evaluate(config, dataset.data_dir, training.checkpoint_dir, workdir, refresh=refresh, **logged_to(training))


@stage_task(
    "export",
    key_fn=lambda config, evaluation, **_: export_key(config, evaluation.key),
    is_valid=lambda result: find_export(Path(result.export_dir).parent, result.key) is not None,
)
def export_model(
    config: PipelineConfig,
    dataset: DataResult,
    training: TrainResult,
    evaluation: EvaluationResult,
    workdir: str,
    refresh: bool = False,
) -> ExportResult:
    """Exports the evaluated checkpoint as a verified SavedModel version (an earlier one of the same key is kept)."""
    import_tensorflow()
    from cifar.export import export_model as export_saved_model

    data_dir, checkpoint_dir = dataset.data_dir, training.checkpoint_dir
    return export_saved_model(
        config, data_dir, checkpoint_dir, workdir, evaluation, refresh=refresh, **logged_to(training)
    )


# No task retries: registration is idempotent per export, and the MLflow client retries its HTTP requests.
@stage_task(
    "register",
    key_fn=lambda config, training, export, **_: registration_key(config, export.key, training.tracking_uri),
    is_valid=lambda result: True,  # A registered version and its recorded decision stay in the registry.
)
def register_model(
    config: PipelineConfig,
    dataset: DataResult,
    training: TrainResult,
    evaluation: EvaluationResult,
    export: ExportResult,
) -> PromotionResult:
    """Registers the export in MLflow and moves the champion alias only if it passes the gate."""
    import_tensorflow()
    from cifar.registry import register_and_promote

    trained_with = TrainedWith.of(config, dataset, training)  # Recorded on the version: what made it.
    result = register_and_promote(
        config, export, dataset.data_dir, **logged_to(training), trained_with=trained_with, evaluation=evaluation
    )
    publish_comparison(result)
    publish_model_card(result)
    if result.champion and not result.reused:  # Moved now, by the gate (a reused decision was announced then).
        at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        move = {"how": "gate", "from_version": result.champion_version_before, "to_version":
                result.registered_model_version, "by": "gate", "reason": result.reason, "at": at}  # fmt: skip
        announce_move(config.export.model_name, move)
    return result
