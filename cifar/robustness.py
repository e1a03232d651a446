"""Accuracy under the CIFAR-10-C common corruptions: per corruption and severity, their mean, the drop from clean.

The corrupted images are made from a fixed subset of the test split (`subset_indices`: 2,000 by default, every
image for headline figures) by `cifar.corruptions`, and cached under a content key: the subset's pixels, the
seed and the generator's version. A model is scored through a `logits(images) -> (N, classes)` function, so
the same code measures a Keras checkpoint, an exported SavedModel or a registered MLflow model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cifar import corruptions
from cifar.io import atomic_write_bytes

# Bumped whenever cifar.corruptions would make different bytes from the same input: old caches are not reused.
GENERATOR_VERSION = 1
DEFAULT_SUBSET = 2000
SUBSET_SEED = 20190506  # Which test images form the subset (fixed: every run measures the same images).

Logits = Callable[[np.ndarray], np.ndarray]


def subset_indices(num_examples: int, size: int | None) -> np.ndarray:
    """`size` test images chosen once by a fixed seed, in increasing order (all of them when size is None or larger)."""
    if size is None or size >= num_examples:
        return np.arange(num_examples)
    if size < 1:
        raise ValueError(f"the robustness subset must hold at least one image, got {size}")
    chosen = np.random.default_rng(SUBSET_SEED).permutation(num_examples)[:size]
    return np.sort(chosen)


def cache_key(images: np.ndarray, seed: int) -> str:
    digest = hashlib.sha256(np.ascontiguousarray(images).tobytes())
    digest.update(json.dumps({"seed": seed, "generator": GENERATOR_VERSION}).encode())
    return digest.hexdigest()[:16]


def corrupted_images(images: np.ndarray, name: str, seed: int, cache_dir: Path | None) -> np.ndarray:
    """(5, N, 32, 32, 3) uint8: `images` at severities 1-5, read from `cache_dir` when made before."""
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"{cache_key(images, seed)}-{name}.npy"
        try:
            cached = np.load(path, allow_pickle=False)  # Plain arrays only: nothing is unpickled.
        except (OSError, ValueError, EOFError):  # Absent, or damaged (made again and replaced below).
            cached = None
        if (
            cached is not None
            and cached.shape == (len(corruptions.SEVERITIES), *images.shape)
            and cached.dtype == np.uint8
        ):
            return cached
    made = np.stack([corruptions.corrupt(images, name, severity, seed) for severity in corruptions.SEVERITIES])
    if path is not None:
        import io

        buffer = io.BytesIO()
        np.save(buffer, made, allow_pickle=False)
        atomic_write_bytes(path, buffer.getvalue())  # Written whole or not at all: concurrent runs may share it.
    return made


@dataclass(frozen=True)
class RobustnessReport:
    """Accuracy of one model on the subset: clean, and per corruption and severity."""

    images: int  # Test images per corruption and severity.
    clean_accuracy: float  # On the same subset, for the drop.
    accuracy: dict[str, list[float]]  # Corruption -> accuracy at severities 1-5.
    correct: dict[str, np.ndarray] = field(repr=False, compare=False)  # Corruption -> (5, N) bool, for paired tests.

    @property
    def per_corruption(self) -> dict[str, float]:
        return {name: float(np.mean(values)) for name, values in self.accuracy.items()}

    @property
    def mean_corruption_accuracy(self) -> float:
        """The benchmark's headline: the mean over the corruptions and severities."""
        return float(np.mean([np.mean(values) for values in self.accuracy.values()]))

    @property
    def drop(self) -> float:
        """Clean accuracy minus the mean corruption accuracy, in accuracy units (0.10 = 10 points)."""
        return self.clean_accuracy - self.mean_corruption_accuracy

    def metrics(self) -> dict[str, float]:
        """MLflow metrics: robustness.mean_corruption_accuracy, robustness.drop, robustness.<name>, .<name>.s<k>."""
        flat = {
            "robustness.mean_corruption_accuracy": self.mean_corruption_accuracy,
            "robustness.clean_accuracy": self.clean_accuracy,
            "robustness.drop": self.drop,
        }
        for name, values in self.accuracy.items():
            flat[f"robustness.{name}"] = float(np.mean(values))
            for severity, value in zip(corruptions.SEVERITIES, values):
                flat[f"robustness.{name}.s{severity}"] = value
        return flat

    def to_json(self) -> dict:
        return {
            "images": self.images,
            "clean_accuracy": self.clean_accuracy,
            "mean_corruption_accuracy": self.mean_corruption_accuracy,
            "drop": self.drop,
            "accuracy": self.accuracy,
        }


def measure(
    logits: Logits,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    seed: int = 0,
    names: tuple[str, ...] = corruptions.CORRUPTIONS,
    cache_dir: Path | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    clean_predictions: np.ndarray | None = None,
) -> RobustnessReport:
    """Scores `images` (the subset) clean and under every corruption in `names` at severities 1-5.

    `clean_predictions`: the subset's predicted classes when the caller has them (the evaluation scored the
    test split already): then the clean images are not scored again."""
    labels = np.asarray(labels, np.int64)
    if len(images) != len(labels) or len(labels) == 0:
        raise ValueError(f"expected as many labels as images (at least one), got {len(images)} and {len(labels)}")
    if clean_predictions is None:
        clean_predictions = np.argmax(logits(images), axis=1)
    clean_correct = clean_predictions == labels
    accuracy: dict[str, list[float]] = {}
    correct: dict[str, np.ndarray] = {}
    for done, name in enumerate(names):
        variants = corrupted_images(images, name, seed, cache_dir)
        flat = variants.reshape(-1, *images.shape[1:])  # Every severity in one call: larger batches, fewer calls.
        hits = (np.argmax(logits(flat), axis=1) == np.tile(labels, len(variants))).reshape(len(variants), -1)
        correct[name] = hits
        accuracy[name] = [float(row.mean()) for row in hits]
        if progress is not None:
            progress(name, done + 1, len(names))
    return RobustnessReport(
        images=len(labels), clean_accuracy=float(clean_correct.mean()), accuracy=accuracy, correct=correct
    )
