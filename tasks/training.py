"""The training task: trains (or resumes) the model and reports each epoch as a progress bar."""

from __future__ import annotations

from cifar import failpoints
from cifar.checkpoints import RunDirectory
from cifar.config import PipelineConfig
from cifar.quiet import import_tensorflow
from cifar.results import DataResult, TrainResult
from cifar.reuse import finished_training_key
from tasks.artifacts import ProgressReporter
from tasks.caching import stage_task


@stage_task(
    "train",
    key_fn=lambda config, dataset, **_: finished_training_key(config, dataset.key),
    is_valid=lambda result: RunDirectory(result.run_dir).completed(result.key) is not None,
    tags=["training"],  # A tag concurrency limit of 1 keeps two trainings off one device.
)
def train_model(config: PipelineConfig, dataset: DataResult, workdir: str, refresh: bool = False) -> TrainResult:
    """Trains the model, resuming from the last checkpoint of the same run when there is one."""
    import_tensorflow()
    from cifar.train import train

    progress = ProgressReporter("training", f"Training {config.train.model} for {config.train.epochs} epochs")
    callbacks = []
    if config.trial is not None:  # A search trial: report every epoch to the study, stop when pruned.
        from cifar.search.pruning import TrialPruning

        callbacks.append(TrialPruning(config.trial, config.train.epochs))

    def report_epoch(values: dict) -> None:
        progress.epoch(values)
        failpoints.reached("train.reported", int(values["epoch"]))  # A drill's crash, the checkpoint on disk.

    return train(config, dataset.data_dir, workdir, refresh=refresh, epoch_callback=report_epoch, callbacks=callbacks)
