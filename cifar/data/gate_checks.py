"""The data validation gate's checks: the new data's schema, size, drift, duplicates and leakage, in one report.

Each check reports its measured value beside its threshold (`ValidateConfig`), as TFDV's anomalies do,
and lists the files at fault; the checks and why their thresholds: docs/DATA.md ("The validation gate").
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from cifar.config import ValidateConfig
from cifar.data.drift import Profile, image_drift, label_drift
from cifar.data.manifest import IMAGE_SHAPE, NUM_CLASSES
from cifar.data.plan import SnapshotPlan
from cifar.data.snapshots import StoredPart, now
from cifar.text import printable

MAX_LISTED = 200  # Offending files listed per check in the one-line error's report; the JSON lists them all.


class CheckResult(BaseModel):
    """One check: the measured value, its threshold, whether it passed, and the examples at fault."""

    model_config = ConfigDict(extra="forbid")

    name: str
    passed: bool
    judged: bool = True  # False: reported only (too few new examples to judge drift).
    value: float | None
    threshold: float | None
    summary: str  # One line a person reads.
    details: dict[str, Any] = {}
    examples: list[dict[str, Any]] = []  # The offending files or images, every one of them.


class ValidationReport(BaseModel):
    """The gate's verdict on a snapshot's new data against a reference."""

    model_config = ConfigDict(extra="forbid")

    snapshot: str
    reference: str
    reference_reason: str  # Why this reference: "the training data of champion v3", "the base archive (no champion)".
    new_parts: list[str]
    new_examples: int
    enforce: bool
    passed: bool
    checks: list[CheckResult]
    created_at: str

    def failed(self) -> list[CheckResult]:
        return [check for check in self.checks if not check.passed]

    def metrics(self) -> dict[str, float]:
        """Every measured value, for the run's MLflow metrics (`data_<check>`)."""
        values: dict[str, float] = {"data_new_examples": float(self.new_examples), "data_passed": float(self.passed)}
        for check in self.checks:
            if check.value is not None and math.isfinite(check.value):
                values[f"data_{check.name}"] = float(check.value)
        for name, value in self.check("image_statistics").details.get("divergence", {}).items():
            if value is not None and math.isfinite(value):
                values[f"data_image_drift_{name}"] = float(value)
        return values

    def check(self, name: str) -> CheckResult:
        return next(check for check in self.checks if check.name == name)

    def error_line(self, report_path: str | None = None) -> str:
        failed = "; ".join(f"{check.name}: {check.summary}" for check in self.failed())
        where = f" (full report: {report_path})" if report_path else ""
        return f"data validation failed: {failed}{where}"


class DataValidationError(ValueError):
    """New data failed the validation gate; the report says which checks and which files."""

    def __init__(self, report: ValidationReport, report_path: str | None = None) -> None:
        super().__init__(report.error_line(report_path))
        self.report = report
        self.report_path = report_path


def run_checks(
    snapshot: str,
    reference: str,
    reference_reason: str,
    new_parts: list[StoredPart],
    plan: SnapshotPlan,
    reference_profile: Profile,
    reference_examples: int,
    settings: ValidateConfig,
) -> ValidationReport:
    """Runs every check on the new parts against the reference's profile and size."""
    new_profile = sum((part.analysis.profile() for part in new_parts), Profile())
    added = new_profile.count
    checks = [
        _schema(new_parts, settings),
        _size(added, reference_examples, settings),
        *_drift(new_profile, reference_profile, settings),
        *_exclusions([part.digest for part in new_parts], plan, added, settings),
    ]
    return ValidationReport(
        snapshot=snapshot,
        reference=reference,
        reference_reason=reference_reason,
        new_parts=[part.digest for part in new_parts],
        new_examples=added,
        enforce=settings.enforce,
        passed=all(check.passed for check in checks),
        checks=checks,
        created_at=now(),
    )


def _schema(new_parts, settings: ValidateConfig) -> CheckResult:
    problems = [
        {"addition": record.digest[:12], "file": problem.file, "problem": problem.problem, "detail": problem.detail}
        for record in (part.record for part in new_parts)
        for problem in record.problems
    ]
    for part in new_parts:  # The stored arrays themselves (digest-checked when loaded).
        record, images, labels = part.record, part.images, part.labels
        if images.dtype != np.uint8 or images.shape[1:] != IMAGE_SHAPE or len(labels) != len(images):
            detail = f"images {images.dtype} {images.shape}, {len(labels)} labels"
            problems.append(
                {"addition": record.digest[:12], "file": "images.npy", "problem": "shape", "detail": detail}
            )
        outside = np.flatnonzero((labels < 0) | (labels >= NUM_CLASSES))
        for index in outside[:MAX_LISTED].tolist():
            problems.append(
                {
                    "addition": record.digest[:12],
                    "file": record.names[index] if index < len(record.names) else str(index),
                    "problem": "label",
                    "detail": f"label {int(labels[index])} outside 0..{NUM_CLASSES - 1}",
                }
            )
    count = len(problems)
    kinds: dict[str, int] = {}
    for problem in problems:
        kinds[problem["problem"]] = kinds.get(problem["problem"], 0) + 1
    shown = ", ".join(f"{printable(item['file'])} ({item['problem']})" for item in problems[:5])
    more = f" and {count - 5} more" if count > 5 else ""
    summary = f"{count} unusable files: {shown}{more}" if count else "every file is a 32x32 RGB image of a known class"
    return CheckResult(
        name="schema",
        passed=count <= settings.max_invalid_files,
        value=float(count),
        threshold=float(settings.max_invalid_files),
        summary=summary + (f" (at most {settings.max_invalid_files} allowed)" if count else ""),
        details={"by_problem": kinds},
        examples=problems,
    )


def _size(added: int, reference_examples: int, settings: ValidateConfig) -> CheckResult:
    ratio = added / reference_examples if reference_examples else 0.0
    return CheckResult(
        name="size",
        passed=ratio <= settings.max_added_ratio,
        value=ratio,
        threshold=settings.max_added_ratio,
        summary=f"{added:,} examples added to {reference_examples:,}: ratio {ratio:.3f} "
        f"({'at most' if ratio <= settings.max_added_ratio else 'above'} {settings.max_added_ratio:g})",
        details={"examples_added": added, "reference_examples": reference_examples},
    )


def _drift(new: Profile, reference: Profile, settings: ValidateConfig) -> list[CheckResult]:
    # Below `min_examples_for_drift` new images, drift is reported, not judged: a handful says little.
    judged = new.count >= settings.min_examples_for_drift
    note = "" if judged else f" (not judged: {new.count} new examples < {settings.min_examples_for_drift})"
    if new.count == 0:
        return [
            CheckResult(
                name=name, passed=True, judged=False, value=None, threshold=threshold, summary="no new examples"
            )
            for name, threshold in (
                ("label_distribution", settings.max_label_drift),
                ("image_statistics", settings.max_image_drift),
            )
        ]
    labels = label_drift(new, reference)
    new_share = np.asarray(new.classes) / max(new.count, 1)
    worst = int(np.argmax(np.abs(new_share - np.asarray(reference.classes) / max(reference.count, 1))))
    divergence = image_drift(new, reference)
    worst_feature = max(divergence, key=lambda name: divergence[name])
    image = divergence[worst_feature]
    return [
        CheckResult(
            name="label_distribution",
            passed=not judged or labels <= settings.max_label_drift,
            judged=judged,
            value=labels,
            threshold=settings.max_label_drift,
            summary=f"L-infinity {labels:.3f} (class {worst}: {100 * new_share[worst]:.1f} % of the new examples), "
            f"threshold {settings.max_label_drift:g}{note}",
            details={"new_class_counts": new.classes, "reference_class_counts": reference.classes},
        ),
        CheckResult(
            name="image_statistics",
            passed=not judged or image <= settings.max_image_drift,
            judged=judged,
            value=image,
            threshold=settings.max_image_drift,
            summary=f"Jensen-Shannon divergence {image:.4f} ({worst_feature}), threshold {settings.max_image_drift:g}"
            f"{note}",
            details={
                "divergence": divergence,
                "new_histograms": new.features,
                "reference_histograms": reference.features,
            },
        ),
    ]


def _exclusions(digests: list[str], plan: SnapshotPlan, added: int, settings: ValidateConfig) -> list[CheckResult]:
    results = []
    for reason, name, limit in (
        ("duplicate", "duplicates", settings.max_duplicate_fraction),
        ("leakage", "leakage", settings.max_leakage_fraction),
    ):
        items = [
            {"addition": digest[:12], **item.model_dump(exclude={"reason"})}
            for digest in digests
            for item in plan.part(digest).excluded_for(reason)
        ]
        share = len(items) / added if added else 0.0
        conflicts = sum(1 for item in items if item["conflicting_label"])
        what = "dropped" if reason == "duplicate" else "kept out of training"
        shown = ", ".join(f"{printable(item['name'])} ~ {printable(item['of'])}" for item in items[:3])
        summary = (
            f"{len(items)} of {added:,} new images {what} ({100 * share:.2f} %, at most {100 * limit:g} %): {shown}"
            + (f" and {len(items) - 3} more" if len(items) > 3 else "")
            if items
            else f"none among {added:,} new images"
        )
        results.append(
            CheckResult(
                name=name,
                passed=share <= limit,
                value=share,
                threshold=limit,
                summary=summary,
                details={"count": len(items), "conflicting_labels": conflicts}
                if reason == "duplicate"
                else {"count": len(items)},
                examples=items,
            )
        )
    return results
