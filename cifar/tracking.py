"""MLflow helpers shared by the stages: where the store is, and logging into one pipeline run.

The embedded default is a SQLite store at `WORKDIR/mlflow.db` with artifacts in `WORKDIR/mlartifacts/`;
`MLFLOW_TRACKING_URI` (or `tracking.tracking_uri` in the config) points at a real server instead.
One MLflow run spans a pipeline run: training creates it, evaluation and export log into it by id.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from cifar.config import TrackingConfig


def resolve_tracking_uri(tracking: TrackingConfig, workdir: str | Path) -> str:
    """Config value, else MLFLOW_TRACKING_URI, else the SQLite store under the workdir."""
    if tracking.tracking_uri:
        return tracking.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(workdir).resolve() / 'mlflow.db'}"


def default_artifact_location(tracking_uri: str, workdir: str | Path, experiment: str) -> str | None:
    """Artifacts of the embedded store live beside it; a server decides for itself (None)."""
    if tracking_uri.startswith("sqlite:///"):
        return (Path(workdir).resolve() / "mlartifacts" / experiment).as_uri()
    return None


def ensure_experiment(tracking_uri: str, workdir: str | Path, name: str) -> str:
    """The experiment id of `name`, created with a predictable artifact location if missing."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = default_artifact_location(tracking_uri, workdir, name)
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # Another process created it first: use theirs.
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


@contextlib.contextmanager
def use_run(tracking_uri: str, run_id: str) -> Iterator["mlflow.ActiveRun"]:  # noqa: F821
    """Resumes `run_id` as the active MLflow run for `mlflow.log_*` calls.

    Reuses it if it is already active; otherwise the run is ended on exit (FINISHED, or FAILED
    on an exception) and the next stage resumes it again by id.
    """
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        yield active
        return
    with mlflow.start_run(run_id=run_id) as run:
        yield run


def end_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    """Marks the pipeline's run as ended (FINISHED or FAILED)."""
    import mlflow

    mlflow.MlflowClient(tracking_uri=tracking_uri).set_terminated(run_id, status=status)
