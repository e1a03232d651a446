"""A prediction job's result, the monitoring verdict on what it scored, and its drift figure."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from cifar.config import MonitorConfig
from cifar.data.additions import FileProblem
from cifar.data.drift import FEATURE_RANGES, Profile
from cifar.monitoring import MonitoringReference, MonitoringReport, monitor
from cifar.predict.sources import KIND_NAMES
from cifar.text import printable


class PredictionResult(BaseModel):
    """What a prediction job scored, where the outputs are, and how the images compare with the model's reference."""

    model_config = ConfigDict(extra="forbid")

    key: str  # <input digest[:16]>-<model>-v<version>
    output_dir: str
    predictions_path: str
    summary_path: str
    drift_png: str
    input: str
    kind: str
    digest: str
    resize: str | None
    model_name: str
    model_version: int
    model_uri: str  # As asked for when the images were scored.
    images: int
    problems: list[FileProblem]
    class_names: list[str]  # Index = class id; "class <i>" for a class the model never answered.
    class_counts: list[int]  # Predicted images per class.
    confidence_threshold: float
    low_confidence_share: float
    profile: Profile  # The scored images' features; classes = predicted class counts.
    monitoring: MonitoringReport | None  # None: no reference recorded for the version, or nothing scored.
    monitoring_note: str | None = None
    seconds: float  # Reading, scoring, monitoring and writing (not loading the model).
    images_per_second: float
    mlflow_run_id: str | None
    tracking_uri: str
    created_at: str
    reused: bool = False

    @property
    def drift(self) -> bool:
        return self.monitoring is not None and self.monitoring.drift

    def verdict(self) -> str:
        """One line: drift and why, no drift, or why it was not judged."""
        report = self.monitoring
        if report is None:
            return f"not judged: {self.monitoring_note}"
        if not report.judged:
            return f"not judged: {report.examples} images, fewer than monitor.min_examples"
        if report.drift:
            return "DRIFT: " + "; ".join(report.reasons)
        return (
            f"no drift (image {report.image_drift_max:.4f} {report.worst_feature}, predictions "
            f"{report.prediction_drift:.3f}, unsure {100 * report.low_confidence_share:.1f} %)"
        )

    def summary(self) -> str:
        """A few lines for a person: what was scored with what, where it went, the verdict."""
        reused = " (already scored: not scored again)" if self.reused else ""
        skipped = f", {len(self.problems)} files skipped" if self.problems else ""
        lines = [
            f"Scored {self.images:,} images of {self.input} ({KIND_NAMES[self.kind]}) with "
            f"{self.model_name} v{self.model_version}{skipped}{reused}",
            f"  predictions {self.predictions_path}",
            f"  drift       {self.verdict()}",
        ]
        for problem in self.problems[:10]:
            lines.append(f"  skipped     {printable(problem.file)}: {problem.problem} ({printable(problem.detail)})")
        if len(self.problems) > 10:
            lines.append(f"  skipped     ... {len(self.problems) - 10} more in {self.summary_path}")
        return "\n".join(lines)


def judged_again(
    result: PredictionResult, reference: MonitoringReference | None, settings: MonitorConfig
) -> PredictionResult:
    """A finished job's result, its verdict judged under `settings` from its recorded profile and answers."""
    report, note = judge(result.profile, result.class_counts, result.low_confidence_share, reference, settings)
    return result.model_copy(update={"monitoring": report, "monitoring_note": note, "reused": True})


def judge(
    profile: Profile,
    class_counts: list[int],
    low_confidence_share: float,
    reference: MonitoringReference | None,
    settings: MonitorConfig,
) -> tuple[MonitoringReport | None, str | None]:
    """(report, note): the monitoring report against the reference, or None and why there is none."""
    if reference is None:
        return None, "no monitoring reference recorded for this version (registered before references were)"
    if profile.count == 0:
        return None, "no images were scored"
    note = None
    if reference.confidence_threshold != settings.confidence_threshold:
        # The reference's share was counted at its own threshold: the current one is too, to compare like with like.
        note = (
            f"low confidence counted below the reference's threshold {reference.confidence_threshold:g}, "
            f"not monitor.confidence_threshold {settings.confidence_threshold:g}"
        )
        settings = settings.model_copy(update={"confidence_threshold": reference.confidence_threshold})
    return monitor(reference, profile, class_counts, low_confidence_share, settings), note


def drift_png(result: PredictionResult, reference: MonitoringReference | None) -> bytes:
    """The scored images' histograms over the reference's, per feature, and the predicted classes."""
    from cifar.plots import drift_png as plot

    report = result.monitoring
    features = {}
    for name, (low, high) in FEATURE_RANGES.items():
        value = f"JS divergence {report.image_drift[name]:.4f}" if report is not None else "no reference"
        reference_counts = reference.images.features[name] if reference is not None else None
        features[name] = (reference_counts, result.profile.features.get(name, [0]), (low, high), value)
    value = f"L-infinity {report.prediction_drift:.3f}" if report is not None else "no reference"
    classes = (reference.predictions if reference is not None else None, result.class_counts, value)
    title = (
        f"{result.images:,} images of {Path(result.input).name} against {result.model_name} v{result.model_version}'s "
        "reference (training images; answers on the test split)"
    )
    return plot(features, classes, result.class_names, title)
