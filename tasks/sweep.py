"""Tasks of the sweep: one MLflow parent run that groups the child pipeline runs, and a comparison table."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact

from cifar.config import PipelineConfig
from cifar.tracking import ensure_experiment, mlflow_client, resolve_tracking_uri

PARENT_TAG = "mlflow.parentRunId"  # The tag the MLflow UI nests child runs under.


@task(name="open-sweep-run", retries=2, retry_delay_seconds=5)
def open_sweep_run(config: PipelineConfig, workdir: str, name: str, grid: dict[str, list]) -> str:
    """Creates the MLflow parent run of a sweep and returns its id."""
    tracking_uri = resolve_tracking_uri(config.tracking, workdir)
    experiment_id = ensure_experiment(tracking_uri, workdir, config.tracking.experiment)
    client = mlflow_client(tracking_uri)
    run = client.create_run(experiment_id, run_name=name, tags={"cifar.sweep": "parent", "preset": config.preset})
    for key, values in grid.items():
        client.log_param(run.info.run_id, f"sweep.{key}", ",".join(map(str, values)))
    return run.info.run_id


@task(name="attach-child-run", retries=2, retry_delay_seconds=5)
def attach_child_run(tracking_uri: str, parent_run_id: str, child_run_id: str) -> None:
    """Nests a pipeline's MLflow run under the sweep's parent run."""
    client = mlflow_client(tracking_uri)
    client.set_tag(child_run_id, PARENT_TAG, parent_run_id)
    client.set_tag(child_run_id, "cifar.sweep", "child")


@task(name="close-sweep-run", retries=2, retry_delay_seconds=5)
def close_sweep_run(tracking_uri: str, parent_run_id: str, rows: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Logs the best child on the parent run, ends it, and publishes the comparison table."""
    client = mlflow_client(tracking_uri)
    scored = [row for row in rows if row.get(metric) is not None]
    best = max(scored, key=lambda row: row[metric]) if scored else {}
    if best:
        client.log_metric(parent_run_id, f"best_{metric}", best[metric])
        client.set_tag(parent_run_id, "best_child_run_id", best["mlflow_run_id"])
        client.set_tag(parent_run_id, "best_model", f"{best['model']} lr={best['learning_rate']}")
    client.set_terminated(parent_run_id, status="FINISHED")
    create_table_artifact(rows, key="cifar-sweep", description=f"Sweep runs; best by {metric}: {best or 'none'}")
    return best
