"""A prediction job's MLflow run: its own run in the experiment `cifar10-predictions`, the model version its input."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from cifar.predict.job import DRIFT_PNG, SUMMARY_FILE, Job
from cifar.predict.result import PredictionResult

EXPERIMENT = "cifar10-predictions"  # The MLflow experiment of prediction jobs.


def start_run(job: Job) -> str:
    """The job's MLflow run (RUNNING): its params, the model version as its input, tags linking the version."""
    from urllib.parse import urlsplit

    from cifar.tracking import NOTE_TAG, create_run, log_params, mlflow_client, source_tags

    source, version, tracking_uri = job.source, job.version, job.tracking_uri
    tags = {
        **source_tags(),
        "mlflow.source.name": "flows/predict.py",
        "model_name": version.name,
        "model_version": str(version.version),
        "model_uri": version.uri,
        NOTE_TAG: f"Batch prediction of `{source.path}` with registered model {version.name} version "
        f"{version.version} (asked for as `{version.requested}`).",
    }
    if urlsplit(tracking_uri).scheme in {"http", "https"}:
        tags["registry_url"] = f"{tracking_uri.rstrip('/')}/#/models/{version.name}/versions/{version.version}"
    run_name = f"predict-{version.name}-v{version.version}-{job.digest[:8]}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    run_id = create_run(tracking_uri, job.workdir, EXPERIMENT, run_name, tags)
    params = {
        "input": source.path,
        "input_kind": source.kind,
        "input_digest": job.digest,
        "input_files": len(source.files),
        "model_uri": version.requested,
        "model_version": version.version,
        "resize": source.resize,
        "chunk_size": job.chunk_size,
    }
    log_params(tracking_uri, run_id, params)
    if version.model_id:
        from mlflow.entities import LoggedModelInput

        mlflow_client(tracking_uri).log_inputs(run_id, models=[LoggedModelInput(version.model_id)])
    return run_id


def finish_run(tracking_uri: str, run_id: str, result: PredictionResult, directory: Path) -> None:
    """The job's values as single-value metrics, its verdict as a tag, summary.json and drift.png as artifacts."""
    from mlflow.entities import Metric

    from cifar.tracking import finite_metrics, mlflow_client

    client = mlflow_client(tracking_uri)
    metrics = {
        "images": float(result.images),
        "skipped_files": float(len(result.problems)),
        "images_per_second": result.images_per_second,
        "seconds": result.seconds,
        "low_confidence_share": result.low_confidence_share,
    }
    if result.monitoring is not None:
        metrics |= result.monitoring.metrics()
    timestamp = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, timestamp, 0) for k, v in finite_metrics(metrics).items()])
    client.set_tag(run_id, "monitoring", "drift" if result.drift else "no drift" if result.monitoring else "not judged")
    for name in (SUMMARY_FILE, DRIFT_PNG):
        client.log_artifact(run_id, str(directory / name))
