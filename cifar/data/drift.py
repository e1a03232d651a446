"""What a set of images looks like, and how far two sets are apart: the one implementation of drift.

The data validation gate and batch monitoring compare the same summaries (`Profile`: histograms of
per-image brightness, contrast and channel means, and of classes) with the same measures (Jensen-Shannon
divergence per feature, L-infinity of class shares), as TFDV does for numeric and categorical features.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict

from cifar.data.manifest import NUM_CLASSES

LUMA_WEIGHTS = np.array([0.299, 0.587, 0.114], np.float32)  # ITU-R BT.601, as PIL's "L" conversion.
# Each feature's histogram range in pixel units, in 16 bins. Two samples of one distribution differ by
# about bins / (8 N ln 2) through chance alone: on CIFAR-10 images the worst of the five features
# measured 0.017 for 200 images (0.028 at most in 20 draws), 0.004 for 1,000, 0.0005 for 10,000,
# against 0.08 for the same images brightened by 20 % and 0.23 by 40 % (docs/DATA.md).
FEATURE_RANGES = {
    "brightness": (0.0, 255.0),
    "contrast": (0.0, 128.0),
    "mean_red": (0.0, 255.0),
    "mean_green": (0.0, 255.0),
    "mean_blue": (0.0, 255.0),
}
FEATURES = tuple(FEATURE_RANGES)
BINS = 16
CHUNK_IMAGES = 4096  # Images converted to float at a time: 48 MB of float32, whatever the input's size.


def image_features(images: np.ndarray) -> dict[str, np.ndarray]:
    """Per-image brightness, contrast and channel means (float32 (N,) each) of uint8 images (N, H, W, 3)."""
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected uint8 images (N, H, W, 3), got {images.dtype} {images.shape}")
    features = {name: np.empty(len(images), np.float32) for name in FEATURES}
    for start in range(0, len(images), CHUNK_IMAGES):
        pixels = images[start : start + CHUNK_IMAGES].reshape(-1, images.shape[1] * images.shape[2], 3)
        pixels = pixels.astype(np.float32)  # (n, H*W, 3)
        gray = pixels @ LUMA_WEIGHTS  # (n, H*W)
        # Channel means as one matrix product: 4x faster than numpy's mean over the strided pixel axis (the
        # training split's features were ~3 s of every registration), and exact: sums of at most 2^24 / 255
        # uint8 values are integers float32 holds exactly.
        means = (np.ones((1, pixels.shape[1]), np.float32) @ pixels)[:, 0, :] / pixels.shape[1]  # (n, 3)
        stop = start + len(pixels)
        features["brightness"][start:stop] = gray.mean(axis=1)
        features["contrast"][start:stop] = gray.std(axis=1)
        for channel, name in enumerate(("mean_red", "mean_green", "mean_blue")):
            features[name][start:stop] = means[:, channel]
    return features


def feature_histogram(name: str, values: np.ndarray) -> list[int]:
    """Counts of `values` in the feature's fixed bins (values outside the range land in the end bins)."""
    low, high = FEATURE_RANGES[name]
    clipped = np.clip(np.asarray(values, np.float64), low, high)
    counts, _ = np.histogram(clipped, bins=BINS, range=(low, high))
    return [int(count) for count in counts]


class Profile(BaseModel):
    """How a set of labelled (or predicted) images is distributed: feature and class histograms.

    Profiles add up: the profile of a snapshot is the sum of its parts' profiles.
    """

    model_config = ConfigDict(extra="forbid")

    count: int = 0
    features: dict[str, list[int]] = {}  # Feature name -> BINS counts over FEATURE_RANGES.
    classes: list[int] = [0] * NUM_CLASSES  # Examples per class id (labels, or predicted classes).

    @classmethod
    def of(cls, features: Mapping[str, np.ndarray], labels: np.ndarray | None = None) -> Profile:
        """The profile of per-image `features` (from `image_features`) and their class ids."""
        count = len(next(iter(features.values()))) if features else 0
        classes = np.bincount(labels, minlength=NUM_CLASSES) if labels is not None else np.zeros(NUM_CLASSES)
        return cls(
            count=count,
            features={name: feature_histogram(name, values) for name, values in features.items()},
            classes=[int(value) for value in classes[:NUM_CLASSES]],
        )

    def __add__(self, other: Profile) -> Profile:
        names = set(self.features) | set(other.features)
        empty = [0] * BINS
        return Profile(
            count=self.count + other.count,
            features={
                name: [a + b for a, b in zip(self.features.get(name, empty), other.features.get(name, empty))]
                for name in sorted(names)
            },
            classes=[a + b for a, b in zip(self.classes, other.classes)],
        )


def js_divergence(counts: list[int] | np.ndarray, reference: list[int] | np.ndarray) -> float:
    """Jensen-Shannon divergence (base 2: 0 = same distribution, 1 = disjoint) of two histograms."""
    p, q = np.asarray(counts, np.float64), np.asarray(reference, np.float64)
    if p.sum() == 0 or q.sum() == 0:
        return float("nan")
    # Imported here: scipy.spatial costs ~0.15 s in every process that imports the flows, and few compare.
    from scipy.spatial.distance import jensenshannon

    # scipy returns the distance, the square root of the divergence.
    return float(jensenshannon(p, q, base=2) ** 2)


def linf_distance(counts: list[int] | np.ndarray, reference: list[int] | np.ndarray) -> float:
    """L-infinity distance of two count vectors' frequencies (the largest difference of one class's share)."""
    p, q = np.asarray(counts, np.float64), np.asarray(reference, np.float64)
    if p.sum() == 0 or q.sum() == 0:
        return float("nan")
    return float(np.max(np.abs(p / p.sum() - q / q.sum())))


def image_drift(current: Profile, reference: Profile) -> dict[str, float]:
    """Jensen-Shannon divergence of each feature's histogram, current against reference; the worst is judged."""
    return {name: js_divergence(current.features[name], reference.features[name]) for name in FEATURES}


def label_drift(current: Profile, reference: Profile) -> float:
    """L-infinity distance of the class frequencies, current against reference."""
    return linf_distance(current.classes, reference.classes)
