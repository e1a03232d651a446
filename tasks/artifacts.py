"""What a pipeline run shows in Prefect: progress bars while stages run, a report and summary.json at the end."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from cifar.io import atomic_write_json
from cifar.results import EvaluationMetrics
from cifar.summary import PipelineSummary, percent
from cifar.text import duration
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
        """Training callback: `{"epoch", "epochs", "seconds_left", **metrics}` after each epoch."""
        epoch, epochs = int(report["epoch"]), int(report["epochs"])
        shown = ", ".join(
            f"{name} {value:.4f}"
            for name, value in sorted(report.items())
            if name not in {"epoch", "epochs", "seconds_left"} and isinstance(value, float)
        )
        left = report.get("seconds_left")
        eta = f", {duration(left)} left" if left and epoch < epochs else ""
        self.update(
            100.0 * epoch / max(epochs, 1), f"{self.description}: epoch {epoch}/{epochs}{eta} ({shown})", force=True
        )

    def finish(self) -> None:
        self.update(100.0, force=True)


def report_markdown(summary: PipelineSummary) -> str:
    """The end-of-run report: accuracy, per-class table, export path and the MLflow run."""
    lines = [f"# CIFAR-10 pipeline: {summary.preset} preset, up to {summary.until}", ""]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in summary.report_rows()]
    metrics_path = summary.evaluation and Path(summary.evaluation.metrics_path)
    per_class = EvaluationMetrics.read(metrics_path).per_class if metrics_path and metrics_path.is_file() else {}
    if per_class:
        lines += [
            "",
            "## Per class (test split)",
            "",
            "| class | accuracy | precision | support |",
            "|---|---|---|---|",
        ]
        for name, values in per_class.items():
            lines.append(f"| {name} | {percent(values.accuracy)} | {percent(values.precision)} | {values.support} |")
    return "\n".join(lines) + "\n"


def _largest_drop(comparison: dict) -> str:
    """The largest per-class loss in words (a drop is a positive number of points)."""
    drop = comparison["largest_class_drop"]
    if drop <= 0:
        return "No class lost accuracy."
    return f"Largest class drop: {comparison['largest_drop_class']}, {100 * drop:.2f} points."


@task(name="report")
def publish_report(summary: PipelineSummary) -> str:
    """Publishes the run's markdown report as a Prefect artifact."""
    markdown = report_markdown(summary)
    create_markdown_artifact(markdown, key="cifar-report", description="CIFAR-10 pipeline run")
    return markdown


@task(name="summary")
def write_summary(summary: PipelineSummary) -> str:
    """Writes WORKDIR/summary.json (the latest run's) and the training run's own copy; returns the first."""
    values = summary.model_dump(mode="json")
    if summary.training is not None:
        atomic_write_json(summary_path(Path(summary.training.run_dir)), values)
    return str(atomic_write_json(summary.summary_path, values))


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
        f"| test accuracy ({comparison['examples']:,} images) | {percent(challenger['accuracy'])} | "
        f"{percent(champion['accuracy']) if champion else '-'} |",
    ]
    if comparison.get("new_data_examples"):
        lines.append(
            f"| new data accuracy ({comparison['new_data_examples']:,} images) | "
            f"{percent(challenger.get('new_data_accuracy'))} | "
            f"{percent(champion.get('new_data_accuracy')) if champion else '-'} |"
        )
    if challenger.get("ece") is not None:
        champion_ece = percent(champion.get("ece")) if champion and champion.get("ece") is not None else "-"
        lines.append(f"| calibration error (ECE, 15 bins) | {percent(challenger['ece'])} | {champion_ece} |")
    if challenger.get("mean_corruption_accuracy") is not None:
        theirs = champion.get("mean_corruption_accuracy") if champion else None
        lines.append(
            f"| mean accuracy under 15 corruptions x 5 severities ({comparison['corruption_examples']:,} images) | "
            f"{percent(challenger['mean_corruption_accuracy'])} | {percent(theirs) if theirs is not None else '-'} |"
        )
    if champion:
        lines += [
            f"| right only for this model | {comparison['challenger_only']} | {comparison['champion_only']} |",
            "",
            f"McNemar's exact test on the {comparison['challenger_only'] + comparison['champion_only']} images where "
            f"they disagree: p = {comparison['p_value']:.4g}. {_largest_drop(comparison)}",
        ]
    for name, verdict in comparison.get("criteria", {}).items():
        lines += ["", f"- **{name}**: {verdict}"]
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
        lines.append(f"| {name} | {percent(theirs) or '-'} | {percent(mine)} | {difference} |")
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
                "champion": percent(comparison["champion"]["per_class"][index]) if comparison.get("champion") else "-",
                "challenger": percent(comparison["challenger"]["per_class"][index]),
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
