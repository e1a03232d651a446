"""Monitoring what a model sees: the images it scores and its answers, against what it was registered with.

Every registered version records its reference (tag `monitoring_reference`): its training images' drift
profile and how it answered the test split. A batch prediction job measures the same and compares, with
the data validation gate's measures and the `monitor` thresholds (docs/BATCH_INFERENCE.md, "Monitoring").
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict

from cifar.config import MonitorConfig
from cifar.data.drift import Profile, image_drift, linf_distance
from cifar.data.manifest import NUM_CLASSES

REFERENCE_TAG = "monitoring_reference"  # On a registry version: its MonitoringReference as JSON.


class MonitoringReference(BaseModel):
    """What a version was registered with: its training images' profile and its answers on the test split."""

    model_config = ConfigDict(extra="forbid")

    images: Profile  # The training split's images (features only; classes are the training labels).
    predictions: list[int]  # Predicted class counts on the test split.
    low_confidence_share: float  # Share of test answers with top probability below the threshold.
    confidence_threshold: float
    test_examples: int


def answers_summary(probabilities: np.ndarray, threshold: float) -> tuple[list[int], float]:
    """(predicted class counts, share of answers whose top probability is below `threshold`)."""
    predicted = np.asarray(probabilities).argmax(axis=1)
    counts = np.bincount(predicted, minlength=NUM_CLASSES)[:NUM_CLASSES]
    low = float(np.mean(np.asarray(probabilities).max(axis=1) < threshold)) if len(predicted) else 0.0
    return [int(count) for count in counts], low


class MonitoringReport(BaseModel):
    """One batch's drift against the model's reference: every value, its threshold, and the verdict."""

    model_config = ConfigDict(extra="forbid")

    examples: int
    judged: bool  # False: too few images to judge (values are reported).
    image_drift: dict[str, float]  # Feature -> Jensen-Shannon divergence.
    worst_feature: str
    image_drift_max: float
    prediction_drift: float
    low_confidence_share: float
    reference_low_confidence_share: float
    thresholds: dict[str, float]
    drift: bool  # At least one value above its threshold (and judged).
    reasons: list[str]  # One line per value above its threshold.

    def metrics(self) -> dict[str, float]:
        """The values as MLflow metrics (single values, for the runs table)."""
        values = {
            "monitor_image_drift": self.image_drift_max,
            "monitor_prediction_drift": self.prediction_drift,
            "monitor_low_confidence_share": self.low_confidence_share,
            "monitor_drift": float(self.drift),
        }
        values |= {f"monitor_image_drift_{name}": value for name, value in self.image_drift.items()}
        return {name: value for name, value in values.items() if value is not None and math.isfinite(value)}


def monitor(
    reference: MonitoringReference,
    images: Profile,
    predictions: list[int],
    low_confidence_share: float,
    settings: MonitorConfig,
) -> MonitoringReport:
    """Compares a batch's image profile and answers with the reference; the verdict under `settings`."""
    divergence = image_drift(images, reference.images)
    worst = max(divergence, key=lambda name: divergence[name])
    prediction = linf_distance(predictions, reference.predictions)
    judged = images.count >= settings.min_examples
    increase = low_confidence_share - reference.low_confidence_share
    reasons = []
    if divergence[worst] > settings.max_image_drift:
        reasons.append(
            f"image drift: Jensen-Shannon divergence {divergence[worst]:.4f} ({worst}) > {settings.max_image_drift:g}"
        )
    if prediction > settings.max_prediction_drift:
        reasons.append(f"prediction drift: L-infinity {prediction:.3f} > {settings.max_prediction_drift:g}")
    if increase > settings.max_low_confidence_increase:
        reasons.append(
            f"low confidence: {100 * low_confidence_share:.1f} % of answers below {settings.confidence_threshold:g}, "
            f"{100 * increase:.1f} points above the test split's {100 * reference.low_confidence_share:.1f} %"
        )
    return MonitoringReport(
        examples=images.count,
        judged=judged,
        image_drift=divergence,
        worst_feature=worst,
        image_drift_max=divergence[worst],
        prediction_drift=prediction,
        low_confidence_share=low_confidence_share,
        reference_low_confidence_share=reference.low_confidence_share,
        thresholds={
            "max_image_drift": settings.max_image_drift,
            "max_prediction_drift": settings.max_prediction_drift,
            "max_low_confidence_increase": settings.max_low_confidence_increase,
            "confidence_threshold": settings.confidence_threshold,
            "min_examples": float(settings.min_examples),
        },
        drift=judged and bool(reasons),
        reasons=reasons,
    )


def load_reference(tracking_uri: str, model_name: str, version: int) -> MonitoringReference | None:
    """The reference a version was registered with, or None (versions registered before it was recorded)."""
    from cifar.tracking import mlflow_client

    tags = mlflow_client(tracking_uri).get_model_version(model_name, str(version)).tags
    return MonitoringReference.model_validate_json(tags[REFERENCE_TAG]) if REFERENCE_TAG in tags else None
