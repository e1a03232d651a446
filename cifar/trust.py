"""The evaluate stage's trust measures of the chosen checkpoint: calibration and robustness to corruptions.

- Calibration (`evaluate.calibration`): a temperature fitted on the validation split by NLL (never on the
  test set; a preset that holds nothing out, such as `fast`, gets none and says so), then the test split's
  ECE, NLL and Brier score before and after it, accuracy at 50/80/90/95 % coverage and the reliability
  diagram (cifar.calibration).
- Robustness (`evaluate.robustness_images`): accuracy on a fixed subset of the test images under the 15
  CIFAR-10-C corruptions at 5 severities (cifar.corruptions, cifar.robustness), their mean and the drop from
  clean, a heat map, and which image was right under which corruption (for the gate's paired comparison).

Written to runs/<run>/evaluation/ beside metrics.json: trust.json (TrustReport), reliability.png,
corruptions.png, robustness_correct.npz. The corrupted images are cached in WORKDIR/data/corruptions/
under a key of their content, so every run of a workdir makes them once.
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

from cifar import calibration, plots, robustness
from cifar.config import EvaluateConfig
from cifar.corruptions import CORRUPTIONS
from cifar.io import atomic_write_bytes, atomic_write_json, read_json

TRUST_NAME = "trust.json"
RELIABILITY_NAME = "reliability.png"
CORRUPTIONS_NAME = "corruptions.png"
CORRECT_NAME = "robustness_correct.npz"  # Corruption -> (5, N) bool: right or wrong per severity and image.
CORRUPTION_CACHE = "corruptions"  # Under WORKDIR/data/.


class TrustReport(BaseModel):
    """trust.json: what the evaluate stage measured beyond accuracy, and where its files are."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None  # Fitted on the validation split; None when nothing was held out.
    temperature_images: int  # Validation images it was fitted on.
    calibration_before: dict[str, float] | None  # ece, nll, brier of the plain softmax on the test split.
    calibration_after: dict[str, float] | None  # The same with the temperature (None without one).
    selective_accuracy: dict[str, float] | None  # Coverage in percent ("90") -> accuracy, most confident first.
    area_under_risk_coverage: float | None
    reliability_plot: str | None
    robustness_images: int  # Test images per corruption and severity (0: not measured).
    robustness_key: str | None  # Content key of those images: two models compare pairwise only on equal keys.
    clean_accuracy: float | None  # On the same images.
    mean_corruption_accuracy: float | None
    corruption_accuracy: dict[str, list[float]] | None  # Corruption -> accuracy at severities 1-5.
    corruptions_plot: str | None
    correct_path: str | None
    seconds: dict[str, float]  # calibration, robustness: what each cost.

    @field_validator("corruption_accuracy")
    @classmethod
    def _in_the_benchmarks_order(cls, accuracy: dict[str, list[float]] | None) -> dict[str, list[float]] | None:
        """Noise, blur, weather, digital, as the benchmark lists them (trust.json stores its keys sorted)."""
        if accuracy is None:
            return None
        return {name: accuracy[name] for name in CORRUPTIONS if name in accuracy} | accuracy

    @property
    def ece(self) -> float | None:
        chosen = self.calibration_after or self.calibration_before
        return chosen["ece"] if chosen else None

    @property
    def corruption_drop(self) -> float | None:
        if self.mean_corruption_accuracy is None or self.clean_accuracy is None:
            return None
        return self.clean_accuracy - self.mean_corruption_accuracy

    def metrics(self) -> dict[str, float]:
        """MLflow metrics: calibration.*, selective.*, robustness.* (see cifar.calibration and cifar.robustness)."""
        flat: dict[str, float] = {}
        if self.temperature is not None:
            flat["calibration.temperature"] = self.temperature
        for name, value in (self.calibration_before or {}).items():
            flat[f"calibration.{name}_before"] = value
        for name, value in (self.calibration_after or self.calibration_before or {}).items():
            flat[f"calibration.{name}"] = value
        for coverage, value in (self.selective_accuracy or {}).items():
            flat[f"selective.accuracy_at_{coverage}"] = value
        if self.area_under_risk_coverage is not None:
            flat["selective.area_under_risk_coverage"] = self.area_under_risk_coverage
        if self.corruption_accuracy:
            flat["robustness.mean_corruption_accuracy"] = self.mean_corruption_accuracy
            flat["robustness.clean_accuracy"] = self.clean_accuracy
            flat["robustness.drop"] = self.corruption_drop
            for name, values in self.corruption_accuracy.items():
                flat[f"robustness.{name}"] = float(np.mean(values))
        return flat

    def correct(self) -> dict[str, np.ndarray] | None:
        """Corruption -> (5, N) bool, read from correct_path (plain arrays: nothing is unpickled)."""
        if not self.correct_path:
            return None
        with np.load(self.correct_path, allow_pickle=False) as stored:
            return {name: stored[name] for name in stored.files}


def measure(
    settings: EvaluateConfig,
    load_logits: Callable[[], robustness.Logits],
    test: tuple[np.ndarray, np.ndarray, np.ndarray],
    validation: tuple[np.ndarray, np.ndarray],
    output_dir: Path,
    cache_dir: Path,
) -> TrustReport | None:
    """Measures a checkpoint: `load_logits()` loads it as images -> logits (called once, only when something is
    measured); `test` is (images, labels, the probabilities evaluation already computed).

    None when both measures are turned off."""
    if not settings.calibration and settings.robustness_images == 0:
        return None
    test_images, test_labels, test_probabilities = test
    loaded = functools.cache(load_logits)  # The checkpoint is loaded once, and only if something is scored.

    def logits(images: np.ndarray) -> np.ndarray:
        return loaded()(images)

    seconds: dict[str, float] = {}
    fields: dict = {"temperature": None, "temperature_images": 0, "calibration_before": None}
    fields.update(calibration_after=None, selective_accuracy=None, area_under_risk_coverage=None)
    fields["reliability_plot"] = None
    if settings.calibration:
        started = time.perf_counter()
        # Log-probabilities are logits up to a constant per row, which no softmax sees: the evaluation's
        # own answers serve, and the test images are not scored again.
        test_logits = np.log(np.clip(test_probabilities, 1e-300, 1.0))
        validation_images, validation_labels = validation
        temperature = None
        if len(validation_labels):
            temperature = calibration.fit_temperature(logits(validation_images), validation_labels)
        report = calibration.calibration_report(test_logits, test_labels, temperature or 1.0)
        reliability = plots.reliability_png(report.reliability_before, report.reliability_after, temperature)
        selective = report.selective
        fields.update(
            temperature=temperature,
            temperature_images=int(len(validation_labels)),
            calibration_before=report.before,
            calibration_after=report.after if temperature is not None else None,
            selective_accuracy={f"{round(c * 100)}": a for c, a in zip(selective.coverages, selective.accuracy)},
            area_under_risk_coverage=selective.area_under_risk_coverage,
            reliability_plot=str(atomic_write_bytes(output_dir / RELIABILITY_NAME, reliability)),
        )  # fmt: skip
        seconds["calibration"] = time.perf_counter() - started

    fields.update(robustness_images=0, robustness_key=None, clean_accuracy=None, mean_corruption_accuracy=None)
    fields.update(corruption_accuracy=None, corruptions_plot=None, correct_path=None)
    if settings.robustness_images != 0:
        started = time.perf_counter()
        chosen = robustness.subset_indices(len(test_labels), settings.robustness_images)
        images = test_images[chosen]
        clean = test_probabilities[chosen].argmax(axis=1)  # The evaluation's answers: not scored again.
        measured = robustness.measure(logits, images, test_labels[chosen], cache_dir=cache_dir, clean_predictions=clean)
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **measured.correct)
        heat_map = plots.corruption_heatmap_png(measured.accuracy, measured.clean_accuracy)
        fields.update(
            robustness_images=measured.images,
            robustness_key=robustness.cache_key(images, 0),
            clean_accuracy=measured.clean_accuracy,
            mean_corruption_accuracy=measured.mean_corruption_accuracy,
            corruption_accuracy=measured.accuracy,
            corruptions_plot=str(atomic_write_bytes(output_dir / CORRUPTIONS_NAME, heat_map)),
            correct_path=str(atomic_write_bytes(output_dir / CORRECT_NAME, buffer.getvalue())),
        )
        seconds["robustness"] = time.perf_counter() - started
    trust = TrustReport(**fields, seconds=seconds)
    atomic_write_json(output_dir / TRUST_NAME, trust.model_dump())
    return trust


def load_report(path: str | Path | None) -> TrustReport | None:
    """trust.json as written by `measure`, or None when there is none (turned off, or an older evaluation)."""
    if not path or not Path(path).is_file():
        return None
    return TrustReport.model_validate(read_json(path))


def corruption_cache(data_dir: str | Path) -> Path:
    """WORKDIR/data/corruptions/ for the prepared data in WORKDIR/data/<dataset>/."""
    return Path(data_dir).parent / CORRUPTION_CACHE


def paired_corruption_shares(
    report: TrustReport | None,
    images: np.ndarray,
    labels: np.ndarray,
    champion: robustness.Logits | None,
    data_dir: str | Path,
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Per image of the challenger's robustness subset, the share of its 75 corrupted versions each model got right.

    The challenger's answers are its evaluation's (the export reproduces them); the champion (`champion`:
    images -> probabilities or logits) scores the same corrupted bytes, read from the workdir's cache.
    None when the challenger's evaluation measured no robustness, or on other test images than these."""
    if report is None or not report.correct_path or not report.robustness_images:
        return None
    chosen = robustness.subset_indices(len(labels), report.robustness_images)
    subset, subset_labels = images[chosen], labels[chosen]
    if len(chosen) != report.robustness_images or robustness.cache_key(subset, 0) != report.robustness_key:
        return None  # Measured on another test split.
    stored = report.correct()
    challenger = np.mean(np.concatenate([stored[name] for name in CORRUPTIONS]), axis=0)
    if champion is None:
        return challenger, None
    hits = []
    for name in CORRUPTIONS:
        variants = robustness.corrupted_images(subset, name, 0, corruption_cache(data_dir))
        answers = np.argmax(champion(variants.reshape(-1, *subset.shape[1:])), axis=1)
        hits.append((answers == np.tile(subset_labels, len(variants))).reshape(len(variants), -1))
    return challenger, np.mean(np.concatenate(hits), axis=0)
