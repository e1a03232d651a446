"""The `cifar-sweep` flow: a grid of models x learning rates, one child `cifar` flow run per point.

    python flows/sweep.py                                     # the smoke preset's grid, locally
    prefect deployment run cifar-sweep/sweep -p models='["resnet20","resnet32"]'

Every child is an ordinary pipeline run; in MLflow they hang under one parent run (docs/ORCHESTRATION.md).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # This checkout first, installed or not.

from flows.runtime import DryRunPlan, Request, dry_run_plan, run_command

from prefect import flow
from prefect.runtime import flow_run

from cifar.config import ConfigOverrides, PipelineConfig, resolve_workdir
from cifar.summary import PipelineSummary
from cifar.tracking import mark_failed, resolve_tracking_uri, run_label
from flows.cli import flow_parser
from flows.pipeline import cifar_pipeline
from tasks.sweep import attach_child_run, close_sweep_run, open_sweep_run

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


def compared_metric(rows: list[dict[str, Any]]) -> str:
    """Validation accuracy when the points have it, else test accuracy."""
    return "val_accuracy" if any(row["val_accuracy"] is not None for row in rows) else "test_accuracy"


def point_row(point: PipelineConfig, summary: PipelineSummary) -> dict[str, Any]:
    """The point's row in the sweep's table: its settings and what its run measured."""
    training, evaluation = summary.training, summary.evaluation
    return {
        "model": point.train.model,
        "learning_rate": point.train.learning_rate,
        "val_accuracy": training.val_accuracy,
        "test_accuracy": evaluation.test_accuracy if evaluation else None,
        "mlflow_run_name": summary.mlflow.name if summary.mlflow else None,
        "run_name": training.run_name,
    }


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
) -> dict[str, Any] | DryRunPlan:
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
            name = run_label(point)
            point = named_point(point, name)
            summary = cifar_pipeline.with_options(flow_run_name=name)(
                config=ConfigOverrides.of(point), workdir=workdir, until=until
            )
            run_id = summary.training.mlflow_run_id
            reused = summary.task_states.get("train") in REUSED_STATES
            child_run_id = attach_child_run(tracking_uri, parent_run_id, run_id, name, reused)
            rows.append(point_row(point, summary) | {"mlflow_run_id": child_run_id})
            if reused:
                rows[-1]["reused_run_id"] = run_id
    except BaseException as error:  # The parent must not stay RUNNING forever.
        mark_failed(tracking_uri, parent_run_id, f"point {name} failed: {type(error).__name__}: {error}")
        raise

    metric = compared_metric(rows)
    best = close_sweep_run(tracking_uri, parent_run_id, rows, metric)
    print(format_sweep(rows, metric, best, parent_run_id))
    return {"parent_run_id": parent_run_id, "runs": rows, "best": best}


def check(args: argparse.Namespace) -> Request:
    """The default grid on ./workdir (a server's form, or `prefect deployment run -p`, sets the parameters)."""

    def run() -> int:
        result = sweep()
        print(format_sweep(result["runs"], compared_metric(result["runs"]), result["best"], result["parent_run_id"]))
        return 0

    return Request(resolve_workdir("./workdir"), run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = flow_parser("sweep", __doc__.split("\n\n")[0])
    return run_command("sweep", parser, check, argv)


if __name__ == "__main__":
    sys.exit(main())
