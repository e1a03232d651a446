"""What a pipeline run shows in Prefect: progress bars while stages run, a report and summary.json at the end."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from cifar.io import atomic_write_json, read_json
from cifar.tracking import UI_MODE_QUERY, mlflow_client, runs_table_url
from cifar.workdir import summary_path

logger = logging.getLogger("tasks.artifacts")

# Each update is an `artifact.updated` event that `prefect deployment run --watch` prints: a bar moves
# only after both this long and this far (a forced update, e.g. at an epoch's end, always goes).
MIN_UPDATE_SECONDS = 5.0
MIN_UPDATE_PERCENT = 5.0


class ProgressReporter:
    """A Prefect progress artifact (0-100 %) for one stage; failures to report never fail the stage."""

    def __init__(self, key: str, description: str) -> None:
        self.key = key
        self.description = description
        self.artifact_id = None
        self.last_percent = -100.0
        self.last_time = 0.0

    def update(self, percent: float, description: str | None = None, *, force: bool = False) -> None:
        """Moves the bar to `percent` (throttled unless forced)."""
        percent = min(max(percent, 0.0), 100.0)
        now = time.monotonic()
        due = percent - self.last_percent >= MIN_UPDATE_PERCENT and now - self.last_time >= MIN_UPDATE_SECONDS
        if not (force or due):
            return
        self.last_percent, self.last_time = percent, now
        try:
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(
                    percent, key=self.key, description=description or self.description
                )
            else:
                update_progress_artifact(self.artifact_id, percent, description=description)
        except Exception as error:  # No API (a bare `.fn()` call in a test), or a transient API error.
            logger.debug("Progress artifact %s not updated: %s", self.key, error)

    def bytes(self, done: int, total: int | None) -> None:
        """Download callback: bytes received of the total."""
        if total:
            self.update(100.0 * done / total, f"{self.description}: {done / 1e6:.1f} of {total / 1e6:.1f} MB")

    def step(self, step: str, fraction: float) -> None:
        """Data-stage callback: the current step and the fraction of the stage done."""
        self.update(100.0 * fraction, f"{self.description}: {step}")

    def epoch(self, report: dict[str, Any]) -> None:
        """Training callback: `{"epoch", "epochs", **metrics}` after each epoch."""
        epoch, epochs = int(report["epoch"]), int(report["epochs"])
        shown = ", ".join(
            f"{name} {value:.4f}"
            for name, value in sorted(report.items())
            if name not in {"epoch", "epochs"} and isinstance(value, float)
        )
        self.update(100.0 * epoch / max(epochs, 1), f"{self.description}: epoch {epoch}/{epochs} ({shown})", force=True)

    def finish(self) -> None:
        self.update(100.0, force=True)


LOCAL_MLFLOW_UI = "http://127.0.0.1:5000"  # Where `make mlflow-ui` serves a local store (MLFLOW_PORT=5000).


def mlflow_run_link(tracking_uri: str | None, run_id: str | None) -> dict[str, str | None]:
    """The run's name and URL in the MLflow UI (and its experiment's runs table), and for a local store
    the command that serves that UI."""
    if not tracking_uri or not run_id:
        return {}
    try:
        info = mlflow_client(tracking_uri).get_run(run_id).info
        experiment_id, name = info.experiment_id, info.run_name
    except Exception as error:
        logger.warning("Could not look up MLflow run %s: %s", run_id, error)
        experiment_id, name = None, None
    served = urlsplit(tracking_uri).scheme in {"http", "https"}
    ui_url = tracking_uri.rstrip("/") if served else LOCAL_MLFLOW_UI
    fragment = f"#/experiments/{experiment_id}/runs/{run_id}" if experiment_id else f"#/runs/{run_id}"
    link = {"mlflow_run_name": name, "mlflow_run_url": f"{ui_url}/{fragment}?{UI_MODE_QUERY}"}
    if experiment_id:
        link["mlflow_runs_url"] = runs_table_url(ui_url, experiment_id)
    if not served:
        link["mlflow_ui_command"] = f"make mlflow-ui MLFLOW_TRACKING_URI={tracking_uri}"
    return link


def format_summary(summary: dict[str, Any]) -> str:
    """A few human lines about what the run produced."""
    states = summary.get("task_states", {})

    def state(*names: str) -> str:
        shown = [f"{name} {states[name].lower()}" for name in names if name in states]
        return f"  [{', '.join(shown)}]" if shown else ""

    def percent(value: Any) -> str:
        return "-" if value is None else f"{100 * value:.2f} %"

    counts = summary.get("counts", {})
    lines = [
        f"cifar pipeline done (preset {summary['preset']}, until {summary['until']})",
        f"  data       {summary['data_dir']}  train/validation/test "
        f"{counts.get('train')}/{counts.get('validation')}/{counts.get('test')}{state('download', 'prepare')}",
    ]
    if summary.get("data_validation"):
        validation = summary["data_validation"]
        lines.append(f"  validation snapshot {validation['snapshot']}: {validation['summary']}{state('validate-data')}")
    if "run_name" in summary:
        lines.append(
            f"  training   {summary['run_name']}: {summary['epochs_completed']} epochs, best epoch "
            f"{summary['best_epoch']}, validation accuracy {percent(summary['val_accuracy'])}{state('train')}"
        )
    if "test_accuracy" in summary:
        tta = [
            f"{name} {percent(summary[key])}"
            for key, name in (("flip_tta_accuracy", "flip TTA"), ("tta_accuracy", "flip+translate TTA"))
            if summary.get(key) is not None
        ]
        if summary.get("test_accuracy_deduplicated") is not None:
            tta.append(f"deduplicated {percent(summary['test_accuracy_deduplicated'])}")
        if summary.get("new_data_accuracy") is not None:
            tta.append(f"new data {percent(summary['new_data_accuracy'])} of {summary['new_data_examples']}")
        lines.append(
            f"  test       accuracy {percent(summary['test_accuracy'])}, loss {summary['test_loss']:.4f}"
            f"{''.join(', ' + item for item in tta)}{state('evaluate')}"
        )
    if "export_dir" in summary:
        lines.append(f"  export     {summary['export_dir']}{state('export')}")
    if "registered_model_version" in summary:
        verdict = "champion" if summary.get("champion") else "not promoted"
        lines.append(
            f"  registry   version {summary['registered_model_version']}, {verdict}: "
            f"{summary.get('promotion_reason')}{state('register')}"
        )
    if summary.get("mlflow_run_url"):
        serve = f"  (after `{summary['mlflow_ui_command']}`)" if summary.get("mlflow_ui_command") else ""
        lines.append(f"  mlflow     {summary['mlflow_run_url']}{serve}")
    lines.append(f"  summary    {summary['summary_path']}")
    return "\n".join(lines)


def report_markdown(summary: dict[str, Any]) -> str:
    """The end-of-run report: accuracy, per-class table, export path and the MLflow run."""
    lines = [f"# CIFAR-10 pipeline: {summary.get('preset', '')} preset, up to {summary.get('until')}", ""]
    rows = [
        ("Data", summary.get("data_dir")),
        (
            "Examples (train/validation/test)",
            "/".join(str(summary.get("counts", {}).get(split, "-")) for split in ("train", "validation", "test")),
        ),
        ("Data snapshot", summary.get("snapshot")),
        ("Data validation", (summary.get("data_validation") or {}).get("summary")),
        ("Training run", _training_run(summary)),
        ("Epochs completed", summary.get("epochs_completed")),
        ("Validation accuracy (best epoch)", _percent(summary.get("val_accuracy"))),
        ("Test accuracy", _percent(summary.get("test_accuracy"))),
        ("Test accuracy with flip TTA", _percent(summary.get("flip_tta_accuracy"))),
        ("Test accuracy with flip + translate TTA", _percent(summary.get("tta_accuracy"))),
        (
            f"Test accuracy without near-duplicates of training images ({summary.get('deduplicated_examples')})",
            _percent(summary.get("test_accuracy_deduplicated")),
        ),
        (f"New data accuracy ({summary.get('new_data_examples')} images)", _percent(summary.get("new_data_accuracy"))),
        ("Export", summary.get("export_dir")),
        ("Registered version", summary.get("registered_model_version")),
        ("Champion", summary.get("champion")),
        ("Promotion", summary.get("promotion_reason")),
        ("MLflow run", _mlflow_link(summary)),
    ]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows if value is not None]
    per_class = _per_class(summary.get("metrics_path"))
    if per_class:
        lines += [
            "",
            "## Per class (test split)",
            "",
            "| class | accuracy | precision | support |",
            "|---|---|---|---|",
        ]
        for name, values in per_class.items():
            lines.append(
                f"| {name} | {_percent(values.get('accuracy'))} | {_percent(values.get('precision'))} | "
                f"{values.get('support', '')} |"
            )
    return "\n".join(lines) + "\n"


def _training_run(summary: dict[str, Any]) -> str | None:
    """The MLflow run's name (what the UIs show) and the training directory's (where the files are)."""
    directory, name = summary.get("run_name"), summary.get("mlflow_run_name")
    return f"{name} (directory runs/{directory})" if name and directory else directory


def _mlflow_link(summary: dict[str, Any]) -> str | None:
    """A clickable link to the run; for a local store, with the command that serves its UI."""
    url, run_id = summary.get("mlflow_run_url"), summary.get("mlflow_run_id")
    if not url:
        return run_id
    link = f"[{summary.get('mlflow_run_name') or run_id}]({url})"
    if summary.get("mlflow_runs_url"):
        link += f", [all runs]({summary['mlflow_runs_url']})"
    command = summary.get("mlflow_ui_command")
    return f"{link} (local store: run `{command}` first)" if command else link


def _largest_drop(comparison: dict) -> str:
    """The largest per-class loss in words (a drop is a positive number of points)."""
    drop = comparison["largest_class_drop"]
    if drop <= 0:
        return "No class lost accuracy."
    return f"Largest class drop: {comparison['largest_drop_class']}, {100 * drop:.2f} points."


def _percent(value: Any) -> str | None:
    return None if value is None else f"{100 * float(value):.2f} %"


def _per_class(metrics_path: str | None) -> dict[str, dict[str, Any]]:
    if not metrics_path or not Path(metrics_path).is_file():
        return {}
    return read_json(metrics_path).get("per_class", {})


@task(name="report")
def publish_report(summary: dict[str, Any]) -> str:
    """Publishes the run's markdown report as a Prefect artifact."""
    markdown = report_markdown(summary)
    create_markdown_artifact(markdown, key="cifar-report", description="CIFAR-10 pipeline run")
    return markdown


@task(name="summary")
def write_summary(summary: dict[str, Any], workdir: str) -> str:
    """Writes WORKDIR/summary.json (the latest run's) and the training run's own copy; returns the first."""
    if summary.get("run_dir"):
        atomic_write_json(Path(summary["run_dir"]) / "summary.json", summary)
    return str(atomic_write_json(summary_path(Path(workdir)), summary))


def comparison_markdown(comparison: dict[str, Any]) -> str:
    """The gate's comparison as a person reads it: the decision, both models' numbers, the per-class table."""
    challenger, champion = comparison["challenger"], comparison.get("champion")
    verdict = "promoted" if comparison["promote"] else "not promoted"
    champion_version = f"v{champion['version']}" if champion else "-"
    lines = [
        f"# Challenger v{challenger['version']}: {verdict} ({comparison['rule']})",
        "",
        comparison["reason"],
        "",
        "| | challenger | champion |",
        "|---|---:|---:|",
        f"| version | v{challenger['version']} | {champion_version} |",
        f"| test accuracy ({comparison['examples']:,} images) | {_percent(challenger['accuracy'])} | "
        f"{_percent(champion['accuracy']) if champion else '-'} |",
    ]
    if comparison.get("new_data_examples"):
        lines.append(
            f"| new data accuracy ({comparison['new_data_examples']:,} images) | "
            f"{_percent(challenger.get('new_data_accuracy'))} | "
            f"{_percent(champion.get('new_data_accuracy')) if champion else '-'} |"
        )
    if champion:
        lines += [
            f"| right only for this model | {comparison['challenger_only']} | {comparison['champion_only']} |",
            "",
            f"McNemar's exact test on the {comparison['challenger_only'] + comparison['champion_only']} images where "
            f"they disagree: p = {comparison['p_value']:.4g}. {_largest_drop(comparison)}",
        ]
    thresholds = ", ".join(f"{name} {value:g}" for name, value in comparison["thresholds"].items())
    lines += [
        "",
        f"Thresholds: {thresholds}.",
        "",
        "| class | champion | challenger | difference |",
        "|---|---:|---:|---:|",
    ]
    for index, name in enumerate(comparison["class_names"]):
        mine = challenger["per_class"][index]
        theirs = champion["per_class"][index] if champion else None
        difference = f"{100 * (mine - theirs):+.2f}" if theirs is not None else "-"
        lines.append(f"| {name} | {_percent(theirs) or '-'} | {_percent(mine)} | {difference} |")
    return "\n".join(lines) + "\n"


def publish_comparison(result) -> None:
    """The gate's comparison as Prefect artifacts: the decision (markdown) and the per-class table."""
    comparison = result.comparison
    if not comparison:
        return
    try:
        create_markdown_artifact(
            comparison_markdown(comparison), key="cifar-comparison", description="Champion against challenger"
        )
        rows = [
            {
                "class": name,
                "champion": _percent(comparison["champion"]["per_class"][index]) if comparison.get("champion") else "-",
                "challenger": _percent(comparison["challenger"]["per_class"][index]),
            }
            for index, name in enumerate(comparison["class_names"])
        ]
        create_table_artifact(rows, key="cifar-comparison-per-class", description=comparison["reason"][:500])
    except Exception as error:  # No API (a bare `.fn()` call in a test).
        logger.debug("Comparison artifacts not published: %s", error)


def publish_model_card(result) -> None:
    """The version's model card as a Prefect markdown artifact."""
    if not result.model_card or not Path(result.model_card).is_file():
        return
    try:
        create_markdown_artifact(
            Path(result.model_card).read_text(encoding="utf-8"),
            key="cifar-model-card",
            description=f"Model card of version {result.registered_model_version}",
        )
    except Exception as error:  # No API (a bare `.fn()` call in a test).
        logger.debug("Model card artifact not published: %s", error)
