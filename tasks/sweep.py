"""Tasks of the sweep: one MLflow parent run that groups the child pipeline runs, and a comparison table."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact

from cifar import run_groups
from cifar.config import PipelineConfig
from cifar.tracking import resolve_tracking_uri

POINT_FIELDS = ("model", "learning_rate")  # What tells the sweep's points apart.


@task(name="open-sweep-run", retries=2, retry_delay_seconds=5)
def open_sweep_run(config: PipelineConfig, workdir: str, name: str, grid: dict[str, list]) -> str:
    """Creates the MLflow parent run of a sweep and returns its id."""
    tracking_uri = resolve_tracking_uri(config.tracking, workdir)
    params = {f"sweep.{key}": ",".join(map(str, values)) for key, values in grid.items()}
    params["preset"] = config.preset
    return run_groups.open_parent_run(
        tracking_uri, workdir, config.tracking.experiment, name, params, {"preset": config.preset}
    )


@task(name="attach-child-run", retries=2, retry_delay_seconds=5)
def attach_child_run(tracking_uri: str, parent_run_id: str, run_id: str, name: str, reused: bool) -> str:
    """Puts a point's MLflow run under the sweep's parent (a linked stand-in for a reused run); returns its id."""
    return run_groups.add_child(tracking_uri, parent_run_id, run_id, name, reused=reused)


@task(name="close-sweep-run", retries=2, retry_delay_seconds=5)
def close_sweep_run(tracking_uri: str, parent_run_id: str, rows: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Logs the comparison on the parent run, ends it, and publishes the comparison table."""
    best = run_groups.close_parent_run(tracking_uri, parent_run_id, rows, metric, POINT_FIELDS)
    shown = [
        {key: _shown(key, value) for key, value in row.items() if key != "mlflow_run_id"}
        | {"mlflow_run_id": row["mlflow_run_id"]}
        for row in rows
    ]
    if best:
        point = ", ".join(f"{field} {best[field]}" for field in POINT_FIELDS)
        description = f"**Best by {metric}: {point}** ({_shown(metric, best[metric])}), {len(rows)} points."
    else:
        description = f"No point has a {metric}."
    create_table_artifact(shown, key="cifar-sweep", description=description)
    return best


def _shown(key: str, value: Any) -> Any:
    """Accuracies as percentages with two decimals; everything else as it is."""
    if value is not None and key.endswith("accuracy"):
        return f"{100 * float(value):.2f} %"
    return value
