"""Tasks of the hyperparameter search (`flows/search.py`) and of a trial's own pipeline run.

The search's side: open the study and its MLflow parent run, nest each finished trial's MLflow run
under the parent, and close the search (plots, summary, table artifact). A trial's side (called by
the `cifar` flow when its config carries a `trial` link): record when it started, and tell the
study how it ended.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from cifar.config import PipelineConfig
from cifar.results import TrainResult
from cifar.search import results
from cifar.search import study as studies
from cifar.search.space import OBJECTIVE, SearchSpace
from cifar.tracking import ensure_experiment, mlflow_client, run_exists

TRIAL_STATE_TAG = "cifar.trial_state"  # COMPLETE | PRUNED | FAIL on each trial's MLflow run.


# --- A trial's pipeline run. ---------------------------------------------------------------------


@task(name="start-trial", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def start_trial(config: PipelineConfig) -> None:
    """Records in the study when this trial's run started."""
    studies.start_trial(config.trial)


@task(name="finish-trial", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def finish_trial(config: PipelineConfig, training: TrainResult) -> str:
    """Tells the study the trial's outcome: COMPLETE with its best validation accuracy, or PRUNED."""
    pruned = training.epochs_completed < config.train.epochs
    return studies.finish_trial(
        config.trial,
        value=training.val_accuracy,
        pruned=pruned,
        mlflow_run_id=training.mlflow_run_id,
        run_name=training.run_name,
    )


# --- The search. ---------------------------------------------------------------------------------


@task(name="open-study", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def open_study(storage: str, study_name: str, space: SearchSpace, seed: int):
    """Creates the study, or loads it when it exists (a restarted search continues it)."""
    return studies.open_study(storage, study_name, space, seed)


@task(name="open-search-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def open_search_run(
    config: PipelineConfig, workdir: str, tracking_uri: str, study, space: SearchSpace, storage: str
) -> str:
    """The study's MLflow parent run: the one the study remembers, else a new one (remembered)."""
    client = mlflow_client(tracking_uri)
    run_id = study.user_attrs.get(studies.PARENT_RUN_ATTR)
    if run_id and run_exists(tracking_uri, run_id):
        client.update_run(run_id, status="RUNNING")  # A resumed search reopens it.
        return run_id
    experiment_id = ensure_experiment(tracking_uri, workdir, config.tracking.experiment)
    tags = {"cifar.search": "parent", "cifar.study": study.study_name, "preset": config.preset}
    run_id = client.create_run(experiment_id, run_name=f"search-{study.study_name}", tags=tags).info.run_id
    params = {
        "search.study": study.study_name,
        "search.storage": studies.redact(storage),
        "search.sampler": space.sampler,
        "search.pruner": space.pruner.kind,
        "search.objective": OBJECTIVE,
        "search.space": json.dumps(space.model_dump(mode="json")["params"], sort_keys=True)[:6000],
    }
    for key, value in params.items():
        client.log_param(run_id, key, value)
    study.set_user_attr(studies.PARENT_RUN_ATTR, run_id)
    return run_id


@task(name="attach-trial-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def attach_trial_run(tracking_uri: str, parent_run_id: str, study_name: str, row: results.TrialRow) -> None:
    """Nests a finished trial's MLflow run under the parent and tags it with the trial's number and state.

    A pruned trial's run keeps the status training gave it (FINISHED: every epoch it trained is
    complete and kept); `cifar.trial_state=PRUNED` is what marks it.
    """
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    if not row.mlflow_run_id:
        return
    client = mlflow_client(tracking_uri)
    tags = {
        MLFLOW_PARENT_RUN_ID: parent_run_id,
        "cifar.search": "trial",
        "cifar.study": study_name,
        "cifar.trial_number": str(row.number),
        TRIAL_STATE_TAG: row.state,
    }
    for key, value in tags.items():
        client.set_tag(row.mlflow_run_id, key, value)


@task(name="close-search", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def close_search(
    study, workdir: str, tracking_uri: str, parent_run_id: str, storage: str, context: dict[str, Any]
) -> results.SearchSummary:
    """Plots, `WORKDIR/search-summary.json` and the table artifact; the parent run gets them and ends."""
    plots = results.write_plots(study, studies.search_dir(workdir) / study.study_name)
    summary = results.build_summary(
        study, storage=storage, parent_run_id=parent_run_id, plots=[str(path) for path in plots], **context
    )
    summary_path = results.write_summary(summary, workdir)

    client = mlflow_client(tracking_uri)
    for path in plots:
        client.log_artifact(parent_run_id, str(path), artifact_path="plots")
    client.log_artifact(parent_run_id, str(summary_path))
    for state, count in summary.counts.model_dump().items():  # By Optuna's state names: trials_complete, ...
        client.log_metric(parent_run_id, f"trials_{state.lower()}", count)
    best = summary.best
    if best:
        client.log_metric(parent_run_id, f"best_{OBJECTIVE}", best.value)
        client.set_tag(parent_run_id, "best_trial", str(best.number))
        if best.mlflow_run_id:
            client.set_tag(parent_run_id, "best_child_run_id", best.mlflow_run_id)
    client.set_terminated(parent_run_id, status="FINISHED")

    table = [
        {
            "trial": row.number,
            "state": row.state,
            OBJECTIVE: row.value,
            "epochs": row.epochs_reported,
            **{f"{name}": value for name, value in row.params.items()},
            "mlflow_run_id": row.mlflow_run_id,
        }
        for row in summary.trials
    ]
    best_text = f"trial {best.number} ({OBJECTIVE} {best.value:.4f})" if best else "none"
    create_table_artifact(table, key="cifar-search", description=f"Study {study.study_name}; best: {best_text}")
    return summary


@task(name="registered-version", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def registered_version(tracking_uri: str, mlflow_run_id: str) -> int | None:
    """The newest registry version made from a training's MLflow run, or None."""
    versions = mlflow_client(tracking_uri).search_model_versions(f"run_id='{mlflow_run_id}'")
    return max((int(version.version) for version in versions), default=None)


def summary_path(workdir: str | Path) -> Path:
    return Path(workdir) / results.SUMMARY_NAME
