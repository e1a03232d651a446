"""Tasks after training: evaluate on the test split, export a SavedModel version, register and gate it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from cifar.config import PipelineConfig
from cifar.results import ExportResult
from tasks.caching import fingerprint, stage_key, stage_task
from tasks.data import Dataset
from tasks.training import Training


class Evaluation(BaseModel):
    """Test metrics of the chosen checkpoint and where its files are."""

    model_config = ConfigDict(extra="ignore")

    epoch: int
    test_accuracy: float
    test_loss: float
    flip_tta_accuracy: float | None = None
    tta_accuracy: float | None = None
    metrics_path: str
    predictions_path: str
    fingerprint: str


class Export(ExportResult):
    """A published, verified SavedModel version."""

    model_config = ConfigDict(extra="ignore")

    fingerprint: str


class Promotion(BaseModel):
    """The registry's answer: the version registered and whether it became the champion."""

    model_config = ConfigDict(extra="ignore")

    registered_model_version: int | None
    champion: bool
    test_accuracy: float
    champion_accuracy_before: float | None = None
    champion_version_before: int | None = None
    model_uri: str | None = None
    reason: str
    export_fingerprint: str  # The export it registered: a new export is a new registration.


def evaluation_key(config: PipelineConfig, dataset: Dataset, training: Training, **_) -> str:
    return stage_key("evaluate", config, {"manifest_sha256": dataset.manifest_sha256,
                                          "checkpoints": training.fingerprint, "run_id": training.mlflow_run_id})


def evaluation_is_valid(evaluation: Evaluation) -> bool:
    return fingerprint([evaluation.metrics_path, evaluation.predictions_path]) == evaluation.fingerprint


def export_key(config: PipelineConfig, dataset: Dataset, training: Training, evaluation: Evaluation, **_) -> str:
    return stage_key("export", config, {"manifest_sha256": dataset.manifest_sha256,
                                        "checkpoints": training.fingerprint, "epoch": evaluation.epoch,
                                        "test_accuracy": evaluation.test_accuracy})


def export_is_valid(export: Export) -> bool:
    return fingerprint([export.export_dir]) == export.fingerprint


def promotion_key(config: PipelineConfig, training: Training, evaluation: Evaluation, export: Export, **_) -> str:
    return stage_key("register", config, {"export": export.fingerprint, "export_dir": export.export_dir,
                                          "test_accuracy": evaluation.test_accuracy,
                                          "tracking_uri": training.tracking_uri})


def promotion_is_valid(promotion: Promotion) -> bool:
    return True  # Its key already holds the export's fingerprint; a registered version stays registered.


@stage_task("evaluate", key_fn=evaluation_key, is_valid=evaluation_is_valid)
def evaluate_model(config: PipelineConfig, dataset: Dataset, training: Training, workdir: str) -> Evaluation:
    """Evaluates the best checkpoint (by validation accuracy) on the test split."""
    from cifar.evaluate import evaluate

    result = evaluate(config, dataset.data_dir, training.checkpoint_dir, workdir,
                      mlflow_run_id=training.mlflow_run_id, tracking_uri=training.tracking_uri)
    return Evaluation(**result.model_dump(),
                      fingerprint=fingerprint([result.metrics_path, result.predictions_path]))


@stage_task("export", key_fn=export_key, is_valid=export_is_valid)
def export_model(config: PipelineConfig, dataset: Dataset, training: Training, evaluation: Evaluation,
                 workdir: str) -> Export:
    """Exports the evaluated checkpoint as the next verified SavedModel version (never overwrites one)."""
    from cifar.export import export_model as export_saved_model

    result = export_saved_model(config, dataset.data_dir, training.checkpoint_dir, workdir,
                                epoch=evaluation.epoch, expected_accuracy=evaluation.test_accuracy,
                                mlflow_run_id=training.mlflow_run_id, tracking_uri=training.tracking_uri)
    return Export(**result.model_dump(), fingerprint=fingerprint([result.export_dir]))


# No task retries: a second attempt could register the same export twice, and the MLflow client
# already retries its HTTP requests.
@stage_task("register", key_fn=promotion_key, is_valid=promotion_is_valid)
def register_model(config: PipelineConfig, training: Training, evaluation: Evaluation, export: Export) -> Promotion:
    """Registers the export in MLflow and moves the champion alias only if it passes the gate."""
    from cifar.registry import register_and_promote

    export_result = ExportResult.model_validate(export.model_dump(include=set(ExportResult.model_fields)))
    result = register_and_promote(config, export_result, evaluation.test_accuracy,
                                  mlflow_run_id=training.mlflow_run_id, tracking_uri=training.tracking_uri)
    return Promotion(**result.model_dump(), export_fingerprint=export.fingerprint)
