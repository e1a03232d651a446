"""Can the probabilities be trusted? Calibration and selective-prediction measures of a classifier's softmax.

- Expected calibration error (ECE) over equal-width confidence bins, negative log-likelihood (NLL) and the
  Brier score: Guo, Pleiss, Sun & Weinberger, "On Calibration of Modern Neural Networks", ICML 2017 (ECE
  with M = 15 bins, section 2; temperature scaling, section 4.2). Brier, Monthly Weather Review 78, 1950
  (summed over the classes, averaged over the images: 0 is perfect, 2 the worst).
- Temperature scaling: one scalar T > 0 divides the logits, fitted by minimising the NLL on held-out data
  (the validation split, never the test set). It changes no prediction (the argmax of logits / T is the
  argmax of the logits), only how confident each one is.
- Selective prediction: answer the most confident fraction of the images (the coverage), refer the rest
  to a person; the accuracy at each coverage and the risk-coverage curve (El-Yaniv & Wiener, JMLR 2010).

Plain numpy (and scipy's scalar minimiser); probabilities are (N, classes) rows summing to 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ECE_BINS = 15  # Guo et al.'s M.
COVERAGES = (0.5, 0.8, 0.9, 0.95)  # Fractions of the images answered, the most confident first.
# The temperature is searched in log space within these bounds: far beyond what any trained net needs
# (CIFAR ResNets land near 1.5-2.5), and finite so that a degenerate fit stays a number.
TEMPERATURE_BOUNDS = (0.05, 20.0)
_TINY = np.finfo(np.float64).tiny  # Probabilities are clipped here before a logarithm: finite, never inf.


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Row-wise softmax of logits / temperature, in float64."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = np.asarray(logits, np.float64) / temperature
    scaled -= scaled.max(axis=1, keepdims=True)
    exponentials = np.exp(scaled)
    return exponentials / exponentials.sum(axis=1, keepdims=True)


def _checked(probabilities: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    probabilities = np.asarray(probabilities, np.float64)
    labels = np.asarray(labels, np.int64)
    if probabilities.ndim != 2 or labels.shape != (probabilities.shape[0],):
        raise ValueError(
            f"expected probabilities (N, classes) and labels (N,), got {probabilities.shape} and {labels.shape}"
        )
    if len(labels) == 0:
        raise ValueError("no examples to measure")
    if labels.min() < 0 or labels.max() >= probabilities.shape[1]:
        raise ValueError(f"labels must be class indices below {probabilities.shape[1]}")
    return probabilities, labels


def negative_log_likelihood(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Mean -log p(true class), in nats."""
    probabilities, labels = _checked(probabilities, labels)
    true_class = probabilities[np.arange(len(labels)), labels]
    return float(-np.mean(np.log(np.maximum(true_class, _TINY))))


def brier_score(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Mean over images of the squared distance between the probabilities and the one-hot label."""
    probabilities, labels = _checked(probabilities, labels)
    one_hot = np.eye(probabilities.shape[1])[labels]
    return float(np.mean(np.sum((probabilities - one_hot) ** 2, axis=1)))


@dataclass(frozen=True)
class ReliabilityBins:
    """Per confidence bin (equal width over (0, 1]): images, their accuracy and their mean confidence."""

    edges: tuple[float, ...]  # bins + 1 edges, 0 to 1.
    counts: tuple[int, ...]
    accuracy: tuple[float, ...]  # NaN where a bin is empty.
    confidence: tuple[float, ...]

    @property
    def expected_calibration_error(self) -> float:
        """Sum over bins of |accuracy - confidence| weighted by the bin's share of the images."""
        total = sum(self.counts)
        return float(
            sum(
                count / total * abs(accuracy - confidence)
                for count, accuracy, confidence in zip(self.counts, self.accuracy, self.confidence)
                if count
            )
        )


def reliability_bins(probabilities: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> ReliabilityBins:
    """The reliability diagram's data: each image falls in the bin (i/bins, (i+1)/bins] of its top probability."""
    probabilities, labels = _checked(probabilities, labels)
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    confidences = probabilities.max(axis=1)
    correct = probabilities.argmax(axis=1) == labels
    # Right-closed bins as in Guo et al.: a confidence of exactly 1/bins belongs to the first bin.
    index = np.clip(np.ceil(confidences * bins).astype(np.int64) - 1, 0, bins - 1)
    counts = np.bincount(index, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        accuracy = np.bincount(index, weights=correct, minlength=bins) / counts
        confidence = np.bincount(index, weights=confidences, minlength=bins) / counts
    return ReliabilityBins(
        edges=tuple(float(edge) for edge in np.linspace(0.0, 1.0, bins + 1)),
        counts=tuple(int(count) for count in counts),
        accuracy=tuple(float(value) for value in accuracy),
        confidence=tuple(float(value) for value in confidence),
    )


def expected_calibration_error(probabilities: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> float:
    """ECE over `bins` equal-width confidence bins (0: confidence matches accuracy in every bin)."""
    return reliability_bins(probabilities, labels, bins).expected_calibration_error


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """The temperature T minimising the NLL of softmax(logits / T) on these (held-out) examples.

    The NLL is smooth and unimodal in log T on real logits; a bounded scalar search in log space finds it
    to ~1e-5 in a few dozen evaluations. Logits that are all ties (a net that learned nothing) give T = 1.
    """
    from scipy.optimize import minimize_scalar

    logits = np.asarray(logits, np.float64)
    _checked(logits, labels)
    if not np.all(np.isfinite(logits)):
        raise ValueError("logits must be finite to fit a temperature")
    if np.ptp(logits, axis=1).max() == 0:
        return 1.0

    def nll(log_temperature: float) -> float:
        return negative_log_likelihood(softmax(logits, math.exp(log_temperature)), labels)

    low, high = (math.log(bound) for bound in TEMPERATURE_BOUNDS)
    result = minimize_scalar(nll, bounds=(low, high), method="bounded", options={"xatol": 1e-6})
    return float(math.exp(result.x))


@dataclass(frozen=True)
class SelectivePrediction:
    """Accuracy when only the most confident images are answered."""

    coverages: tuple[float, ...]
    accuracy: tuple[float, ...]  # At each coverage (the most confident ceil(coverage * N) images).
    curve_coverage: np.ndarray  # The risk-coverage curve: k / N for k = 1..N ...
    curve_risk: np.ndarray  # ... and the error rate among the k most confident.

    def accuracy_at(self, coverage: float) -> float:
        return self.accuracy[self.coverages.index(coverage)]

    @property
    def area_under_risk_coverage(self) -> float:
        """The mean risk over all coverages (lower is better; the error rate when confidence is uninformative)."""
        return float(np.mean(self.curve_risk))


def selective_prediction(
    probabilities: np.ndarray, labels: np.ndarray, coverages: Sequence[float] = COVERAGES
) -> SelectivePrediction:
    """Accuracy at each coverage, most confident first (ties: in image order, so the answer is deterministic)."""
    probabilities, labels = _checked(probabilities, labels)
    for coverage in coverages:
        if not 0 < coverage <= 1:
            raise ValueError(f"coverages must be in (0, 1], got {coverage}")
    order = np.argsort(-probabilities.max(axis=1), kind="stable")
    correct = (probabilities.argmax(axis=1) == labels)[order]
    answered = np.arange(1, len(labels) + 1)
    running_accuracy = np.cumsum(correct) / answered
    kept = [max(1, math.ceil(coverage * len(labels) - 1e-9)) for coverage in coverages]
    return SelectivePrediction(
        coverages=tuple(float(coverage) for coverage in coverages),
        accuracy=tuple(float(running_accuracy[count - 1]) for count in kept),
        curve_coverage=answered / len(labels),
        curve_risk=1.0 - running_accuracy,
    )


@dataclass(frozen=True)
class CalibrationReport:
    """Test-split calibration before and after temperature scaling, with selective prediction after it."""

    temperature: float
    before: dict[str, float]  # ece, nll, brier
    after: dict[str, float]
    reliability_before: ReliabilityBins
    reliability_after: ReliabilityBins
    selective: SelectivePrediction  # Of the calibrated probabilities (same order as before: T keeps the ranking).

    def metrics(self) -> dict[str, float]:
        """Flat MLflow metric names: calibration.ece, calibration.ece_before, selective.accuracy_at_90, ..."""
        flat = {"calibration.temperature": self.temperature}
        for name in ("ece", "nll", "brier"):
            flat[f"calibration.{name}"] = self.after[name]
            flat[f"calibration.{name}_before"] = self.before[name]
        for coverage, accuracy in zip(self.selective.coverages, self.selective.accuracy):
            flat[f"selective.accuracy_at_{round(coverage * 100)}"] = accuracy
        flat["selective.area_under_risk_coverage"] = self.selective.area_under_risk_coverage
        return flat


def measures(probabilities: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> dict[str, float]:
    return {
        "ece": expected_calibration_error(probabilities, labels, bins),
        "nll": negative_log_likelihood(probabilities, labels),
        "brier": brier_score(probabilities, labels),
    }


def calibration_report(
    test_logits: np.ndarray, test_labels: np.ndarray, temperature: float, bins: int = ECE_BINS
) -> CalibrationReport:
    """The test split measured with the raw softmax and with the (validation-fitted) temperature."""
    raw, calibrated = softmax(test_logits), softmax(test_logits, temperature)
    return CalibrationReport(
        temperature=float(temperature),
        before=measures(raw, test_labels, bins),
        after=measures(calibrated, test_labels, bins),
        reliability_before=reliability_bins(raw, test_labels, bins),
        reliability_after=reliability_bins(calibrated, test_labels, bins),
        selective=selective_prediction(calibrated, test_labels),
    )
