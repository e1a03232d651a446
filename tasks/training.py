"""The training task: trains (or resumes) the model and reports each epoch as a progress bar."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict

from cifar.config import PipelineConfig
from tasks.artifacts import ProgressReporter
from tasks.caching import fingerprint, stage_key, stage_task, tracking_uri
from tasks.data import Dataset

# Fault injection for drills and the crash/resume test: with CIFAR_FAULT_AFTER_EPOCH=N the training
# task raises right after epoch N has been reported (its checkpoint is already on disk), exactly as
# a crash mid-training would. Unset in production; nothing else reads it.
FAULT_AFTER_EPOCH_ENV = "CIFAR_FAULT_AFTER_EPOCH"


class InjectedFault(RuntimeError):
    """The failure CIFAR_FAULT_AFTER_EPOCH asked for."""


class Training(BaseModel):
    """Where a training run's checkpoints are, its MLflow run and its validation metrics (no model)."""

    model_config = ConfigDict(extra="forbid")

    run_name: str
    run_dir: str
    checkpoint_dir: str
    mlflow_run_id: str | None
    tracking_uri: str | None
    epochs_completed: int
    best_epoch: int | None
    val_accuracy: float | None
    metrics: dict[str, float]
    fingerprint: str  # Of the checkpoint directory: changes whenever a checkpoint is added, removed or altered.


def training_key(config: PipelineConfig, dataset: Dataset, workdir: str, **_) -> str:
    return stage_key("train", config, {"manifest_sha256": dataset.manifest_sha256,
                                       "tracking_uri": tracking_uri(config, workdir)})


def training_is_valid(training: Training) -> bool:
    return fingerprint([training.checkpoint_dir]) == training.fingerprint


def epoch_reporter(config: PipelineConfig):
    """The per-epoch callback handed to `cifar.train.train`: a progress bar (and the fault, if asked)."""
    progress = ProgressReporter("training", f"Training {config.train.model} for {config.train.epochs} epochs")
    fault_after = os.environ.get(FAULT_AFTER_EPOCH_ENV)

    def on_epoch(report: dict[str, Any]) -> None:
        progress.epoch(report)
        if fault_after and int(report["epoch"]) >= int(fault_after):
            raise InjectedFault(f"{FAULT_AFTER_EPOCH_ENV}={fault_after}: failing after epoch {report['epoch']}")

    return on_epoch


@stage_task(
    "train",
    key_fn=training_key,
    is_valid=training_is_valid,
    tags=["training"],  # A tag concurrency limit of 1 keeps two trainings off one device.
)
def train_model(config: PipelineConfig, dataset: Dataset, workdir: str) -> Training:
    """Trains the model, resuming from the last checkpoint of the same run when there is one."""
    from cifar.train import train

    result = train(config, dataset.data_dir, workdir, epoch_callback=epoch_reporter(config))
    return Training(
        run_name=result.run_name,
        run_dir=str(result.run_dir),
        checkpoint_dir=str(result.checkpoint_dir),
        mlflow_run_id=result.mlflow_run_id,
        tracking_uri=result.tracking_uri,
        epochs_completed=result.epochs_completed,
        best_epoch=result.best_epoch,
        val_accuracy=result.val_accuracy,
        metrics={name: float(value) for name, value in (result.metrics or {}).items()
                 if isinstance(value, (int, float))},
        fingerprint=fingerprint([result.checkpoint_dir]),
    )
