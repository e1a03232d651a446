"""MLflow helpers shared by the stages: where the store is, and logging into one pipeline run.

The embedded default is a SQLite store at `WORKDIR/mlflow.db` with artifacts in `WORKDIR/mlartifacts/`;
`MLFLOW_TRACKING_URI` (or `tracking.tracking_uri` in the config) points at a real server instead.
One MLflow run spans a pipeline run: training creates it, evaluation and export log into it by id.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from cifar import compat, locks
from cifar.config import PipelineConfig, TrackingConfig
from cifar.io import cache_directory

# MLflow 3 opens an experiment in the view its kind names; without the tag it guesses GenAI (traces,
# prompts). Ours compare training runs: the model-training view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"  # The run page's description, rendered as markdown.
# MLflow 3.17's UI picks its mode from the link, not from the kind tag: every link we print asks for the
# model-training view, and the runs table opens a shared view (an experiment tag) with the compared columns.
UI_MODE_QUERY = "workflowType=machine_learning"
SHARED_VIEW = "cifar"
SHARED_VIEW_TAG = f"mlflow.sharedViewState.{SHARED_VIEW}"
COMPARED_COLUMNS = (
    "attributes.`Models`",
    "params.`preset`",
    "params.`train.model`",
    "params.`train.learning_rate`",
    "metrics.`test_accuracy`",
    "metrics.`test_accuracy_deduplicated`",
    "metrics.`best_val_accuracy`",
    "metrics.`training_time_s`",
    "metrics.`data_label_distribution`",
    "metrics.`data_image_statistics`",
)


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


_READY_STORES: set[str] = set()  # Embedded stores this process has already created or checked.


def mlflow_client(tracking_uri: str):
    """An MlflowClient on `tracking_uri` (tracking and registry), its embedded store made ready first."""
    import mlflow

    if tracking_uri.startswith("sqlite:///") and tracking_uri not in _READY_STORES:
        _prepare_sqlite_store(tracking_uri)
    return mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _prepare_sqlite_store(tracking_uri: str) -> None:
    """Creates (or migrates, or repairs) an embedded store once, under a lock every process takes.

    MLflow creates and migrates a SQLite store the first time a process opens it; two processes doing
    that at once both run the migrations and corrupt it (`_alembic_tmp_*` tables left behind, every
    later run failing). Under the lock the first process migrates and the others find it ready.
    """
    import mlflow

    path = Path(tracking_uri.removeprefix("sqlite:///"))
    with locks.exclusive(path.with_name(f".{path.name}.lock"), f"the MLflow store {path}"):
        _finish_interrupted_migration(path)
        if not path.exists():
            _copy_empty_store(path)
        store = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        store.search_experiments(max_results=1)
        store.search_registered_models(max_results=1)
    _READY_STORES.add(tracking_uri)


def _copy_empty_store(path: Path) -> None:
    """A new store starts as a copy of an empty one this machine migrated once for the installed MLflow.

    MLflow builds a new SQLite store by running its whole migration history (~150 Alembic steps; the copy
    saves ~1.2 s of CPU per new workdir, measured on 2 AMD EPYC Zen 4 cores). The copy is the same schema at the
    same revision with no experiment in it; MLflow adds its Default experiment, with this store's own
    artifact location, when it first opens it. Best effort: without a cache directory MLflow migrates.
    """
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        template = _empty_store_template()
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, partial)
        os.replace(partial, path)  # Under the store's lock; a reader never sees half a copy.
    except OSError:
        partial.unlink(missing_ok=True)  # MLflow makes the store itself.


def _empty_store_template() -> Path:
    """The cache's empty, migrated store for the installed MLflow, made once (under a lock) if missing."""
    import mlflow
    from mlflow.store.db.utils import _get_latest_schema_revision

    revision = f"{mlflow.__version__}-{_get_latest_schema_revision()}"  # Private; the head migrations reach.
    template = cache_directory() / "mlflow-stores" / f"empty-{revision}.db"
    if template.is_file():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    with locks.exclusive(template.with_name(f".{template.name}.lock"), "the empty MLflow store"):
        if template.is_file():
            return template
        building = template.with_name(f".{template.name}.{os.getpid()}.partial")
        building.unlink(missing_ok=True)
        uri = f"sqlite:///{building}"
        mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri).search_registered_models(max_results=1)
        with contextlib.closing(sqlite3.connect(building)) as connection, connection:
            # MLflow's Default experiment (id 0) names the artifact location of wherever it was made.
            connection.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
            connection.execute("DELETE FROM experiments WHERE experiment_id = 0")
        os.replace(building, template)
    return template


def _finish_interrupted_migration(path: Path) -> None:
    """Repairs what a migration killed halfway left: Alembic rebuilds a SQLite table as `_alembic_tmp_<t>`,
    then drops `<t>` and renames the copy; a leftover copy is renamed if `<t>` is gone, else dropped."""
    if not path.is_file():
        return
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for temporary in sorted(name for name in tables if name.startswith("_alembic_tmp_")):
            table = temporary.removeprefix("_alembic_tmp_")
            action = (
                f'DROP TABLE "{temporary}"' if table in tables else f'ALTER TABLE "{temporary}" RENAME TO "{table}"'
            )
            connection.execute(action)


def ensure_experiment(tracking_uri: str, workdir: str | Path, name: str) -> str:
    """The experiment id of `name`, created with a predictable artifact location if missing."""

    client = mlflow_client(tracking_uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = default_artifact_location(tracking_uri, workdir, name)
        try:
            client.create_experiment(name, artifact_location=location, tags=experiment_view_tags())
        except Exception:  # Another process created it first: use theirs.
            pass
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise RuntimeError(f"MLflow experiment {name!r} could not be created in {tracking_uri}")
    for key, value in experiment_view_tags().items():  # Also on an experiment made before these existed.
        if experiment.tags.get(key) != value:
            client.set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def experiment_view_tags() -> dict[str, str]:
    """The experiment's model-training kind and the runs table's shared view (columns a person compares)."""
    import json

    view = {"selectedColumns": list(COMPARED_COLUMNS), "orderByKey": "attributes.start_time", "orderByAsc": False}
    return {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, SHARED_VIEW_TAG: json.dumps(view)}


def runs_table_url(ui_url: str, experiment_id: str) -> str:
    """The experiment's runs table in the model-training view, with the compared columns."""
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={SHARED_VIEW}&{UI_MODE_QUERY}"


def run_label(config: PipelineConfig) -> str:
    """What a run trains, `smoke-tutorial-lr0.05`: its Prefect flow run's name, its MLflow run's without the time."""
    return f"{config.preset}-{config.train.model}-lr{config.train.learning_rate:g}"


def human_run_name(config: PipelineConfig, now: datetime | None = None) -> str:
    """The MLflow run name: `tracking.run_name` or `train.run_name` when given, else preset, model, rate, UTC time.

    For example `smoke-tutorial-lr0.05-20261123-1840`: what a person scanning the runs table needs
    to tell runs apart (the training directory's name carries the key instead).
    """
    if config.tracking.run_name or config.train.run_name:
        return config.tracking.run_name or config.train.run_name
    now = now or datetime.now(UTC)
    return f"{run_label(config)}-{now:%Y%m%d-%H%M}"


def finite_metrics(metrics: dict[str, float | None]) -> dict[str, float]:
    """The metrics with a finite value (MLflow would store None or NaN as NaN, which no chart can show),
    to 7 significant digits: float32 values read 0.4072, not 0.40720000863075256, in the runs table."""
    finite = {key: float(value) for key, value in metrics.items() if value is not None and math.isfinite(value)}
    return {key: float(f"{value:.7g}") for key, value in finite.items()}


@contextlib.contextmanager
def use_run(tracking_uri: str, run_id: str) -> Iterator[mlflow.ActiveRun]:  # noqa: F821
    """Resumes `run_id` as the active MLflow run for `mlflow.log_*` calls.

    Reuses it if it is already active; otherwise the run is ended on exit (FINISHED, or FAILED
    on an exception) and the next stage resumes it again by id. The process's tracking URI and
    `MLFLOW_TRACKING_URI` are left as they were.
    """
    import mlflow

    with compat.mlflow_tracking_uri(tracking_uri):
        active = mlflow.active_run()
        if active is not None and active.info.run_id == run_id:
            yield active
            return
        with mlflow.start_run(run_id=run_id) as run:
            yield run


@contextlib.contextmanager
def active_run(tracking_uri: str, run_id: str | None, *, system_metrics: bool) -> Iterator[None]:
    """Makes `run_id` the active run (with system metrics, if asked) for the block; nothing when None.

    The run ends FINISHED when the block succeeds and FAILED when it raises.
    """
    if run_id is None:
        yield
        return
    import mlflow

    with compat.mlflow_tracking_uri(tracking_uri), mlflow.start_run(run_id=run_id, log_system_metrics=system_metrics):
        yield


def end_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    """Marks the pipeline's run as ended (FINISHED or FAILED)."""

    mlflow_client(tracking_uri).set_terminated(run_id, status=status)


def mark_failed(tracking_uri: str, run_id: str, reason: str) -> None:
    """Ends a run FAILED with the reason as its `failure` tag."""

    mlflow_client(tracking_uri).set_tag(run_id, "failure", reason[:5000])
    end_run(tracking_uri, run_id, "FAILED")


# --- Training: the one run of a pipeline, its params, per-epoch metrics and inputs. ---------------


def git_commit(directory: str | Path | None = None) -> str | None:
    """The checked-out commit of the code, or None outside a git repository."""
    import subprocess

    directory = Path(directory) if directory else Path(__file__).resolve().parent
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def source_tags() -> dict[str, str]:
    """What the run page's Source and User show: the pipeline, its commit, the account that ran it."""
    import getpass

    tags = {"mlflow.source.name": "flows/pipeline.py", "mlflow.source.type": "JOB"}
    commit = git_commit()
    tags |= {"git_commit": commit or "unknown"} | ({"mlflow.source.git.commit": commit} if commit else {})
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # No name for this uid (a container): MLflow leaves User empty.
        pass
    return tags


def run_exists(tracking_uri: str, run_id: str) -> bool:
    """Whether the store still has `run_id` (and it is not deleted)."""

    try:
        run = mlflow_client(tracking_uri).get_run(run_id)
    except Exception:  # The store raises MlflowException (RESOURCE_DOES_NOT_EXIST) for unknown ids.
        return False
    return run.info.lifecycle_stage == "active"


def create_run(tracking_uri: str, workdir: str | Path, experiment: str, run_name: str, tags: dict[str, str]) -> str:
    """Creates the pipeline's run (status RUNNING) and returns its id; nothing is made active."""

    experiment_id = ensure_experiment(tracking_uri, workdir, experiment)
    run = mlflow_client(tracking_uri).create_run(experiment_id, run_name=run_name, tags=tags)
    return run.info.run_id


def stringify_params(params: dict) -> dict[str, str]:
    """MLflow params are strings of at most 6,000 characters; None becomes 'None'."""
    return {key: str(value)[:6000] for key, value in params.items()}


def log_params(tracking_uri: str, run_id: str, params: dict) -> None:
    """Logs params in batches of 100 (the store's limit per request)."""
    from mlflow.entities import Param

    client = mlflow_client(tracking_uri)
    items = [Param(key, value) for key, value in stringify_params(params).items()]
    for start in range(0, len(items), 100):
        client.log_batch(run_id, params=items[start : start + 100])


def log_epoch_metrics(tracking_uri: str, run_id: str, epoch: int, metrics: dict[str, float]) -> None:
    """One value per metric at step = epoch (1-based), in one request."""
    from mlflow.entities import Metric

    timestamp = int(time.time() * 1000)
    items = [Metric(key, value, timestamp, int(epoch)) for key, value in finite_metrics(metrics).items()]
    if items:
        mlflow_client(tracking_uri).log_batch(run_id, metrics=items)


def logged_steps(tracking_uri: str, run_id: str, key: str) -> set[int]:
    """The steps already logged for a metric (to back-fill without duplicates after a crash)."""

    history = mlflow_client(tracking_uri).get_metric_history(run_id, key)
    return {metric.step for metric in history}


def manifest_dataset(manifest, data_dir: str | Path):
    """The training data as an MLflow dataset: where the archive came from and a digest of the shards.

    A `MetaDataset` records metadata only; its digest is the data key, so two runs on the same
    prepared data show the same dataset in the UI.
    """
    import warnings

    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import ColSpec, DataType, Schema

    schema = Schema([ColSpec(DataType.binary, "image"), ColSpec(DataType.long, "label")])
    location = manifest.source.location
    if location.startswith(("http://", "https://")):
        source = HTTPDatasetSource(location)
    else:
        with warnings.catch_warnings():  # A local path matches two equivalent local source types.
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(location)
    return MetaDataset(source, name=Path(data_dir).name, digest=manifest.key, schema=schema)


def log_training_input(dataset) -> None:
    """`mlflow.log_input(dataset, context="training")` on the active run, safe for runs starting together.

    MLflow stores a dataset once per experiment and inserts it unless it finds it: two runs on the same
    data starting at once (a parallel search's trials) both inserted, and the second failed on the
    datasets table's unique key. Asked again, MLflow finds the row and only links it to this run.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    for attempt in range(3):
        try:
            mlflow.log_input(dataset, context="training")
            return
        except MlflowException as error:
            if attempt == 2 or not re.search(r"UNIQUE constraint|duplicate key|IntegrityError", str(error)):
                raise


# --- Data validation: the gate's values on the pipeline's run, or on a run of their own when it fails. --


def log_data_validation(tracking_uri: str, run_id: str, metrics: dict[str, float], report_path: str) -> None:
    """The gate's measured values as single-value metrics, its verdict as a tag, its report as an artifact."""
    from mlflow.entities import Metric

    client = mlflow_client(tracking_uri)
    timestamp = int(time.time() * 1000)
    items = [Metric(key, value, timestamp, 0) for key, value in finite_metrics(metrics).items()]
    client.log_batch(run_id, metrics=items)
    client.set_tag(run_id, "data_validation", "passed" if metrics.get("data_passed") else "failed")
    client.log_artifact(run_id, report_path, artifact_path="data_validation")


def failed_validation_run(
    tracking_uri: str,
    workdir: str | Path,
    config: PipelineConfig,
    metrics: dict[str, float],
    report_path: str,
    reason: str,
) -> str:
    """A run of its own for a pipeline the gate stopped before training: params, the values, FAILED with the reason."""
    run_id = create_run(
        tracking_uri, workdir, config.tracking.experiment, human_run_name(config), {**source_tags(), "stage": "data"}
    )
    log_params(tracking_uri, run_id, config.flat())
    log_data_validation(tracking_uri, run_id, metrics, report_path)
    mark_failed(tracking_uri, run_id, reason)
    return run_id
