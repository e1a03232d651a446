"""The `cifar-sweep` flow: a grid of models x learning rates, one child `cifar` flow run per point.

    python flows/sweep.py                                     # the smoke preset's grid, locally
    prefect deployment run cifar-sweep/sweep -p models='["resnet20","resnet32"]'

Every child is an ordinary pipeline run (cached stages, its own training directory); in MLflow the
children hang under one parent run (`mlflow.parentRunId`) so the UI compares them side by side.
Points run one after another: the `training` tag limit would serialise them on one device anyway.
"""

from __future__ import annotations

import itertools
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from prefect import flow  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402

from cifar.config import ConfigOverrides, PipelineConfig  # noqa: E402
from cifar.tracking import mark_failed, resolve_tracking_uri  # noqa: E402
from flows.pipeline import cifar_pipeline, dry_run_plan  # noqa: E402
from tasks.sweep import attach_child_run, close_sweep_run, open_sweep_run  # noqa: E402

ROW_FIELDS = ("val_accuracy", "test_accuracy", "mlflow_run_name", "run_name")
REUSED_STATES = {"Cached", "Reused"}  # The point's training finished in an earlier run.


def grid_point(config: PipelineConfig, model: str, learning_rate: float) -> PipelineConfig:
    """The config of one point: the base config with this model and learning rate."""
    train = config.train.model_copy(update={"model": model, "learning_rate": learning_rate})
    return config.model_copy(update={"train": train.model_validate(train.model_dump())})


def format_sweep(rows: list[dict[str, Any]], metric: str, best: dict[str, Any], parent_run_id: str) -> str:
    """The sweep's points, one line each with the compared metric in percent, the best one marked."""
    lines = [f"cifar sweep done: {len(rows)} points, MLflow parent run {parent_run_id}, best by {metric}"]
    for row in rows:
        value = "-" if row.get(metric) is None else f"{100 * row[metric]:.2f} %"
        marker = "  <- best" if best and row["mlflow_run_id"] == best["mlflow_run_id"] else ""
        reused = "  (reused)" if row.get("reused_run_id") else ""
        lines.append(f"  {row['model']:<10} lr {row['learning_rate']:<8g} {metric} {value}{reused}{marker}")
    return "\n".join(lines)


def named_point(config: PipelineConfig, name: str) -> PipelineConfig:
    """The point's config with its MLflow run named as its Prefect flow run (no effect on any stage key)."""
    return config.model_copy(update={"tracking": config.tracking.model_copy(update={"run_name": name})})


def sweep_flow_run_name() -> str:
    """The sweep's name in the Prefect UI: its preset and grid size (`sweep-smoke-4-points`)."""
    parameters = flow_run.parameters
    preset = ConfigOverrides.model_validate(parameters.get("config") or {}).preset
    points = len(parameters.get("models") or []) * len(parameters.get("learning_rates") or [])
    return f"sweep-{preset}-{points}-points"


@flow(name="cifar-sweep", log_prints=True, flow_run_name=sweep_flow_run_name)
def sweep(
    config: ConfigOverrides = ConfigOverrides(preset="smoke"),
    models: list[str] = ["tiny", "tutorial"],  # noqa: B006  Prefect renders the default in the UI.
    learning_rates: list[float] = [0.02, 0.05],  # noqa: B006
    workdir: str = "./workdir",
    until: Literal["train", "evaluate", "export"] = "evaluate",  # A sweep compares trained models.
) -> dict[str, Any]:
    """Runs the pipeline for every (model, learning rate) and groups the MLflow runs under one parent."""
    config = config.resolve()
    points = [grid_point(config, model, rate) for model, rate in itertools.product(models, learning_rates)]
    grid = {"model": models, "learning_rate": learning_rates}
    plan = dry_run_plan("cifar-sweep", config, workdir, until=until, grid=grid)
    if plan:
        return plan
    tracking_uri = resolve_tracking_uri(config.tracking, workdir)
    parent_run_id = open_sweep_run(config, workdir, f"sweep-{datetime.now(UTC):%Y%m%d-%H%M%S}", grid)

    rows = []
    try:
        for point in points:
            name = f"{point.preset}-{point.train.model}-lr{point.train.learning_rate:g}"
            point = named_point(point, name)
            summary = cifar_pipeline.with_options(flow_run_name=name)(
                config=ConfigOverrides.of(point), workdir=workdir, until=until
            )
            reused = summary["task_states"].get("train") in REUSED_STATES
            child_run_id = attach_child_run(tracking_uri, parent_run_id, summary["mlflow_run_id"], name, reused)
            row = {"model": point.train.model, "learning_rate": point.train.learning_rate}
            rows.append(row | {key: summary.get(key) for key in ROW_FIELDS} | {"mlflow_run_id": child_run_id})
            if reused:
                rows[-1]["reused_run_id"] = summary["mlflow_run_id"]
    except BaseException as error:  # The parent must not stay RUNNING forever.
        mark_failed(tracking_uri, parent_run_id, f"point {name} failed: {type(error).__name__}: {error}")
        raise

    metric = "val_accuracy" if any(row["val_accuracy"] is not None for row in rows) else "test_accuracy"
    best = close_sweep_run(tracking_uri, parent_run_id, rows, metric)
    print(format_sweep(rows, metric, best, parent_run_id))
    return {"parent_run_id": parent_run_id, "runs": rows, "best": best}


if __name__ == "__main__":
    sweep()
