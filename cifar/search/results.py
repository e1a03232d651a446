"""A study as people read it: one row per trial, `WORKDIR/search-summary.json`, and the study's plots."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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


def trial_row(trial) -> dict[str, Any]:
    """number, state, params, value, mlflow_run_id, started, finished (and why it failed)."""
    attrs = trial.user_attrs
    row = {
        "number": trial.number,
        "state": trial.state.name,
        "params": dict(trial.params),
        "value": trial.value if trial.state.name == "COMPLETE" else None,
        "mlflow_run_id": attrs.get(studies.MLFLOW_RUN_ATTR),
        "run_name": attrs.get(studies.RUN_NAME_ATTR),
        "flow_run_id": attrs.get(studies.FLOW_RUN_ATTR),
        "started": attrs.get(studies.STARTED_ATTR) or iso_utc(trial.datetime_start),
        "finished": iso_utc(trial.datetime_complete),
        "epochs_reported": len(trial.intermediate_values),
    }
    if studies.FAILURE_ATTR in attrs:
        row["failure"] = attrs[studies.FAILURE_ATTR]
    return row


def trial_rows(study) -> list[dict[str, Any]]:
    return [trial_row(trial) for trial in study.get_trials(deepcopy=False)]


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The complete trial with the highest value (the lowest number among equals)."""
    complete = [row for row in rows if row["state"] == "COMPLETE" and row["value"] is not None]
    if not complete:
        return None
    best = max(complete, key=lambda row: (row["value"], -row["number"]))
    return {key: best[key] for key in ("number", "params", "value", "mlflow_run_id", "run_name")}


def build_summary(study, *, storage: str, parent_run_id: str | None, **extra: Any) -> dict[str, Any]:
    rows = trial_rows(study)
    counts = {state: sum(row["state"] == state for row in rows) for state in ("COMPLETE", "PRUNED", "FAIL")}
    return {
        "study_name": study.study_name,
        "storage": studies.redact(storage),
        "parent_run_id": parent_run_id,
        "objective": f"{studies.OBJECTIVE} (maximize)",
        "counts": counts,
        "trials": rows,
        "best": best_row(rows),
        **extra,
    }


def write_summary(summary: dict[str, Any], workdir: str | Path) -> Path:
    return atomic_write_json(Path(workdir) / SUMMARY_NAME, summary)


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
