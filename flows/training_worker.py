"""The `cifar-train-worker` flow: one of workers 1..N-1 of a training with `train.workers` = N.

Placed by the chief (the pipeline run's training task, `tasks/cluster.py`) on its work pool, never
started by hand. It prepares its own shards from the same archive (byte-identical, checked by the chief),
joins the job through the Prefect API and trains; only the chief logs, checkpoints, evaluates and exports.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # This checkout first, installed or not.

from flows.runtime import show_stage_logs

from prefect import flow

from cifar.config import ConfigOverrides, resolve_workdir
from cifar.preflight import check_request
from tasks.caching import result_storage
from tasks.cluster import JobTicket
from tasks.data import download_archive, prepare_dataset, resolve_snapshot
from tasks.training import train_worker


@flow(name="cifar-train-worker", log_prints=True)
def cifar_train_worker(config: ConfigOverrides, workdir: str, job: JobTicket) -> dict:
    """Worker `job.index` of training job `job.job`: data, then training with the others."""
    show_stage_logs()
    config = config.resolve()
    check_request(config)
    workdir = str(resolve_workdir(workdir))
    archive = download_archive(config, workdir)
    snapshot = resolve_snapshot(config, archive, workdir)
    dataset = prepare_dataset.with_options(result_storage=result_storage(workdir))(config, archive, snapshot, workdir)
    training = train_worker(config, dataset, workdir, job)
    return {"job": job.job, "index": job.index, "epochs_completed": training.epochs_completed}
