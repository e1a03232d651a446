"""A study as people read it: one row per trial, `WORKDIR/search-summary.json`, and the study's plots."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cifar.io import atomic_write_json
from cifar.search import study as studies

logger = logging.getLogger("cifar.search")

SUMMARY_NAME = "search-summary.json"
PLOTS = ("optimization_history", "param_importances", "intermediate_values")


def iso_utc(moment: datetime | None) -> str | None:
    """ISO-8601 UTC with a Z; Optuna's own times are naive local times."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.astimezone()  # A naive time is this machine's local time.
    return moment.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class TrialRow(BaseModel):
    """One trial as the study knows it: its settings, how it ended and where its runs are."""

    model_config = ConfigDict(extra="forbid")

    number: int
    state: str  # Optuna's: COMPLETE, PRUNED, FAIL, RUNNING or WAITING.
    params: dict[str, Any]
    value: float | None  # The objective (best validation accuracy); only for a COMPLETE trial.
    mlflow_run_id: str | None = None
    run_name: str | None = None
    flow_run_id: str | None = None
    started: str | None = None  # ISO-8601 UTC.
    finished: str | None = None
    epochs_reported: int = 0
    failure: str | None = None  # Why a FAIL trial failed.


class BestTrial(BaseModel):
    """The best complete trial, and what running its settings to `until` afterwards gave."""

    model_config = ConfigDict(extra="forbid")

    number: int
    params: dict[str, Any]
    value: float
    mlflow_run_id: str | None = None
    run_name: str | None = None
    # Filled in by the best trial's evaluation run (flows/search.py `evaluate_best`):
    flow_run_id: str | None = None
    until: str | None = None
    test_accuracy: float | None = None
    registered_model_version: int | None = None


class TrialCounts(BaseModel):
    """Finished trials by state; the JSON keys are Optuna's state names."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, serialize_by_alias=True)

    complete: int = Field(0, alias="COMPLETE")
    pruned: int = Field(0, alias="PRUNED")
    failed: int = Field(0, alias="FAIL")


class SearchSummary(BaseModel):
    """One search: the study, every trial, the best one; `WORKDIR/search-summary.json` and the flow's result."""

    model_config = ConfigDict(extra="forbid")

    study_name: str
    storage: str  # Redacted: no password of a database URL.
    parent_run_id: str | None
    objective: str
    counts: TrialCounts
    trials: list[TrialRow]
    best: BestTrial | None
    preset: str | None = None
    space: dict[str, Any] | None = None
    until: str | None = None
    trials_requested: int | None = None
    parallel: int | None = None
    deployment: str | None = None
    workdir: str | None = None
    plots: list[str] = []

    @property
    def summary_path(self) -> Path | None:
        return Path(self.workdir) / SUMMARY_NAME if self.workdir else None


def trial_row(trial) -> TrialRow:
    attrs = trial.user_attrs
    return TrialRow(
        number=trial.number,
        state=trial.state.name,
        params=dict(trial.params),
        value=trial.value if trial.state.name == "COMPLETE" else None,
        mlflow_run_id=attrs.get(studies.MLFLOW_RUN_ATTR),
        run_name=attrs.get(studies.RUN_NAME_ATTR),
        flow_run_id=attrs.get(studies.FLOW_RUN_ATTR),
        started=attrs.get(studies.STARTED_ATTR) or iso_utc(trial.datetime_start),
        finished=iso_utc(trial.datetime_complete),
        epochs_reported=len(trial.intermediate_values),
        failure=attrs.get(studies.FAILURE_ATTR),
    )


def trial_rows(study) -> list[TrialRow]:
    return [trial_row(trial) for trial in study.get_trials(deepcopy=False)]


def best_row(rows: list[TrialRow]) -> BestTrial | None:
    """The complete trial with the highest value (the lowest number among equals)."""
    complete = [row for row in rows if row.state == "COMPLETE" and row.value is not None]
    if not complete:
        return None
    best = max(complete, key=lambda row: (row.value, -row.number))
    return BestTrial(**best.model_dump(include={"number", "params", "value", "mlflow_run_id", "run_name"}))


def build_summary(study, *, storage: str, parent_run_id: str | None, **context: Any) -> SearchSummary:
    """The summary of the study as it stands; `context` fills the search's own fields (preset, space, ...)."""
    rows = trial_rows(study)
    states = [row.state for row in rows]
    return SearchSummary(
        study_name=study.study_name,
        storage=studies.redact(storage),
        parent_run_id=parent_run_id,
        objective=f"{studies.OBJECTIVE} (maximize)",
        counts=TrialCounts(
            complete=states.count("COMPLETE"), pruned=states.count("PRUNED"), failed=states.count("FAIL")
        ),
        trials=rows,
        best=best_row(rows),
        **context,
    )


def write_summary(summary: SearchSummary, workdir: str | Path) -> Path:
    return atomic_write_json(Path(workdir) / SUMMARY_NAME, summary.model_dump(mode="json"))


def write_plots(study, directory: Path) -> list[Path]:
    """PNGs of the optimisation history, the parameter importances and the per-epoch values.

    Each plot needs enough finished trials (importances: two complete trials whose settings differ);
    a plot that cannot be drawn yet is skipped with a log line, never failing the search.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as optuna_plots

    studies.quiet_optuna()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in PLOTS:
        try:
            axes = getattr(optuna_plots, f"plot_{name}")(study)
            figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
            path = directory / f"{name}.png"
            figure.set_size_inches(8, 5)
            figure.tight_layout()
            figure.savefig(path, dpi=100)
            written.append(path)
        except Exception as error:  # Too few trials for this plot, or nothing that varies.
            logger.info("study plot %s skipped: %s", name, error)
        finally:
            plt.close("all")
    return written
