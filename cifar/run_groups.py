"""Groups of MLflow runs: a parent run (a sweep) with one child run per point, compared on the parent.

The MLflow UI nests a run under the run named by its `mlflow.parentRunId` tag. A point whose training
was reused from an earlier run must not move that run under this parent (it belongs to its own
history, perhaps to another sweep): the point gets a child run of its own that copies the params and
the metrics a person compares, and links to the run it reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cifar.plots import figure_png, new_figure
from cifar.tracking import NOTE_TAG, ensure_experiment, finite_metrics, mlflow_client

PARENT_TAG = "mlflow.parentRunId"  # The tag the MLflow UI nests child runs under.
ROLE_TAG = "cifar.sweep"  # parent | child
REUSED_TAG = "cifar.reused_run_id"  # On a child that stands for a reused run: that run's id.
# The single values copied onto a stand-in child: what the runs table and the compare page show.
COMPARED_METRICS = (
    "test_accuracy",
    "test_accuracy_flip_tta",
    "test_accuracy_tta",
    "test_loss",
    "best_val_accuracy",
    "training_time_s",
    "epochs_completed",
)


def open_parent_run(
    tracking_uri: str, workdir: str, experiment: str, name: str, params: dict[str, str], tags: dict[str, str]
) -> str:
    """Creates the parent run (RUNNING) with its params; returns its id."""
    client = mlflow_client(tracking_uri)
    experiment_id = ensure_experiment(tracking_uri, workdir, experiment)
    run = client.create_run(experiment_id, run_name=name, tags={ROLE_TAG: "parent", **tags})
    for key, value in params.items():
        client.log_param(run.info.run_id, key, value)
    return run.info.run_id


def add_child(tracking_uri: str, parent_run_id: str, run_id: str, name: str, *, reused: bool) -> str:
    """Nests `run_id` under the parent, or for a reused run (or one another parent owns) a stand-in child.

    Returns the id of the child run now under the parent.
    """
    client = mlflow_client(tracking_uri)
    run = client.get_run(run_id)
    owner = run.data.tags.get(PARENT_TAG)
    if not reused and owner in (None, parent_run_id):
        client.set_tag(run_id, PARENT_TAG, parent_run_id)
        client.set_tag(run_id, ROLE_TAG, "child")
        return run_id
    return _stand_in_child(client, parent_run_id, run, name)


def _stand_in_child(client, parent_run_id: str, reused, name: str) -> str:
    """A FINISHED child with the reused run's params and compared metrics, linking to it."""
    from mlflow.entities import Metric, Param

    info = reused.info
    tags = {
        PARENT_TAG: parent_run_id,
        ROLE_TAG: "child",
        REUSED_TAG: info.run_id,
        NOTE_TAG: f"Reused the finished run **{info.run_name}** ([open it](#/experiments/{info.experiment_id}/runs/"
        f"{info.run_id})): its training, evaluation and export were not repeated.",
    }
    tags |= {key: value for key, value in reused.data.tags.items() if not key.startswith("mlflow.") and key != ROLE_TAG}
    child = client.create_run(info.experiment_id, run_name=name, tags=tags)
    params = [Param(key, value) for key, value in reused.data.params.items()]
    metrics = finite_metrics({key: reused.data.metrics.get(key) for key in COMPARED_METRICS})
    for start in range(0, len(params), 100):
        client.log_batch(child.info.run_id, params=params[start : start + 100])
    client.log_batch(child.info.run_id, metrics=[Metric(key, value, 0, 0) for key, value in metrics.items()])
    client.set_terminated(child.info.run_id, status="FINISHED")
    return child.info.run_id


def close_parent_run(
    tracking_uri: str, parent_run_id: str, rows: Sequence[dict[str, Any]], metric: str, label_fields: Sequence[str]
) -> dict[str, Any]:
    """Logs the comparison table, a chart and the best point on the parent, then ends it FINISHED.

    `rows` are the points (their fields, `metric` and `mlflow_run_id`); returns the best row ({} if none scored).
    """
    client = mlflow_client(tracking_uri)
    scored = [row for row in rows if row.get(metric) is not None]
    best = max(scored, key=lambda row: row[metric]) if scored else {}
    columns = sorted({key for row in rows for key in row}, key=lambda key: (key not in label_fields, key))
    client.log_table(parent_run_id, {key: [row.get(key) for row in rows] for key in columns}, "comparison.json")
    if scored:
        labels = [" ".join(f"{row[field]}" for field in label_fields) for row in scored]
        client.log_image(parent_run_id, _chart(labels, [row[metric] for row in scored], metric), "comparison.png")
    if best:
        for key, value in finite_metrics({f"best_{metric}": best[metric]}).items():
            client.log_metric(parent_run_id, key, value)
        client.set_tag(parent_run_id, "best_child_run_id", best["mlflow_run_id"])
        client.set_tag(parent_run_id, "best_point", " ".join(f"{field}={best[field]}" for field in label_fields))
    client.set_terminated(parent_run_id, status="FINISHED")
    return best


def _chart(labels: Sequence[str], values: Sequence[float], metric: str):
    """A horizontal bar chart of `metric` per point, in percent, as an RGB array."""
    import io

    import numpy as np
    from PIL import Image

    figure = new_figure(figsize=(7, 0.5 * len(labels) + 1.2))
    axes = figure.add_subplot()
    percents = [100 * value for value in values]
    bars = axes.barh(labels, percents, color="#3b75af")
    axes.bar_label(bars, labels=[f"{value:.2f} %" for value in percents], padding=3)
    axes.set(xlabel=f"{metric} (%)", xlim=(0, max(100.0, max(percents) * 1.15)), title=f"Sweep: {metric} per point")
    axes.invert_yaxis()  # The first point on top, as in the table.
    return np.asarray(Image.open(io.BytesIO(figure_png(figure))).convert("RGB"))
