"""The training tasks: the pipeline's (trains or resumes, reports each epoch as a progress bar; with
`train.workers` > 1 it is the chief of a job) and a job's other workers'."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from cifar import failpoints
from cifar.checkpoints import RunDirectory
from cifar.config import PipelineConfig
from cifar.quiet import import_tensorflow
from cifar.results import DataResult, TrainResult
from cifar.reuse import finished_training_key
from tasks.artifacts import ProgressReporter
from tasks.caching import stage_task
from tasks.cluster import JobTicket, PrefectRendezvous


@stage_task(
    "train",
    key_fn=lambda config, dataset, **_: finished_training_key(config, dataset.key),
    is_valid=lambda result: RunDirectory(result.run_dir).completed(result.key) is not None,
    tags=["training"],  # A tag concurrency limit of 1 keeps two trainings off one device (a job's chief holds it).
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

    rendezvous = PrefectRendezvous.chief(config, workdir) if config.train.workers > 1 else None
    try:
        return train(
            config,
            dataset.data_dir,
            workdir,
            refresh=refresh,
            epoch_callback=report_epoch,
            callbacks=callbacks,
            rendezvous=rendezvous,
        )
    finally:
        if rendezvous is not None:
            rendezvous.close()


@task(name="train-worker", cache_policy=NO_CACHE)  # No `training` tag: the job's chief holds the slot.
def train_worker(config: PipelineConfig, dataset: DataResult, workdir: str, ticket: JobTicket) -> TrainResult:
    """Joins the job as worker `ticket.index` and trains with the others; the chief writes everything."""
    import_tensorflow()
    from cifar.train import train

    def report_epoch(values: dict) -> None:
        print(f"Worker {ticket.index}: epoch {values['epoch']}/{values['epochs']}, loss {values.get('loss', 0):.4f}")
        failpoints.reached("train.worker-reported", int(values["epoch"]))  # A worker's own crash, for drills.

    rendezvous = PrefectRendezvous(config, workdir, ticket)
    return train(config, dataset.data_dir, workdir, epoch_callback=report_epoch, rendezvous=rendezvous)
