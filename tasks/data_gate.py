"""The data validation gate as a task: every run, before training; its report in Prefect and MLflow."""

from __future__ import annotations

import logging

from prefect import task
from prefect.artifacts import create_markdown_artifact

from cifar.champion import find_champion
from cifar.config import PipelineConfig
from cifar.data.gate import check_prepared
from cifar.data.gate_checks import DataValidationError, ValidationReport
from cifar.results import ArchiveInfo, DataResult, TrainResult, ValidationResult
from cifar.tracking import failed_validation_run, log_data_validation, resolve_tracking_uri

logger = logging.getLogger("tasks.data_gate")

LISTED = 20  # Offending files shown per check in the Prefect report (the JSON report has them all).


# Not cached: the reference (the champion's training data) may have changed since the data was prepared.
@task(name="validate-data")
def validate_data(config: PipelineConfig, archive: ArchiveInfo, dataset: DataResult, workdir: str) -> ValidationResult:
    """Checks the snapshot's new data against the champion's; stops the run before training when a check fails."""
    tracking_uri = resolve_tracking_uri(config.tracking, workdir)
    champion = find_champion(tracking_uri, config.export.model_name)
    report, path = check_prepared(config, dataset.data_dir, archive.path, workdir, champion)
    publish_validation(report, str(path))
    result = validation_result(report, str(path))
    print(f"Data validation: {result.summary}")
    if not report.passed and report.enforce:
        error = DataValidationError(report, str(path))
        try:  # The values are logged even though no training run will exist.
            failed_validation_run(tracking_uri, workdir, config, result.metrics, str(path), str(error))
        except Exception as logging_error:  # The gate's verdict matters more than its MLflow record.
            logger.warning("Could not log the failed validation to MLflow: %s", logging_error)
        raise error
    return result


@task(name="log-data-validation")
def log_validation(validation: ValidationResult, training: TrainResult) -> None:
    """The gate's values on the training's MLflow run (every run, so a reused training shows today's)."""
    if training.mlflow_run_id:
        log_data_validation(training.tracking_uri, training.mlflow_run_id, validation.metrics, validation.report_path)


def validation_result(report: ValidationReport, report_path: str) -> ValidationResult:
    if report.passed:
        summary = f"passed: {report.new_examples:,} new examples against {report.reference_reason}"
    else:
        summary = report.error_line(report_path)
        if not report.enforce:
            summary += " (validate.enforce is false: recorded, going on)"
    return ValidationResult(
        passed=report.passed,
        enforce=report.enforce,
        snapshot=report.snapshot,
        reference=report.reference,
        reference_reason=report.reference_reason,
        new_examples=report.new_examples,
        failed=[check.name for check in report.failed()],
        summary=summary,
        report_path=report_path,
        metrics=report.metrics(),
    )


def validation_markdown(report: ValidationReport, report_path: str) -> str:
    """The report as a person reads it: each check's verdict, value and threshold, then the files at fault."""
    verdict = "passed" if report.passed else ("FAILED" if report.enforce else "failed (not enforced)")
    lines = [
        f"# Data validation {verdict}: snapshot {report.snapshot}",
        "",
        f"{report.new_examples:,} new examples in {len(report.new_parts)} additions, "
        f"against {report.reference_reason}.",
        f"Full report: `{report_path}`",
        "",
        "| check | result | value | threshold | |",
        "|---|---|---:|---:|---|",
    ]
    for check in report.checks:
        result = "pass" if check.passed else "**FAIL**"
        result = result if check.judged else "not judged"
        value = "-" if check.value is None else f"{check.value:.4g}"
        threshold = "-" if check.threshold is None else f"{check.threshold:.4g}"
        lines.append(f"| {check.name} | {result} | {value} | {threshold} | {check.summary} |")
    for check in report.checks:
        if not check.examples:
            continue
        lines += ["", f"## {check.name}: {len(check.examples)} images or files", ""]
        for example in check.examples[:LISTED]:
            shown = ", ".join(f"{key} {value}" for key, value in example.items() if value not in (None, False))
            lines.append(f"- {shown}")
        if len(check.examples) > LISTED:
            lines.append(f"- ... {len(check.examples) - LISTED} more in the JSON report")
    return "\n".join(lines) + "\n"


def publish_validation(report: ValidationReport, report_path: str) -> None:
    try:
        create_markdown_artifact(
            validation_markdown(report, report_path),
            key="cifar-data-validation",
            description=f"Data validation of snapshot {report.snapshot}",
        )
    except Exception as error:  # No API (a bare `.fn()` call in a test).
        logger.debug("Validation artifact not published: %s", error)
