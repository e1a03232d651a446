"""What the gate and the data stage need to know about each part of a snapshot, computed once and kept.

Per image of a part (the archive's batches, each addition): a 64-bit content hash and the drift features;
for the archive also its test fingerprints and its own test near-duplicates. Kept beside what they describe
(docs/DATA.md, "The store") under `analysis_key`, so the archive's (about a second) is paid once per archive.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cifar import locks
from cifar.data.archive import RawDataset
from cifar.data.drift import FEATURES, Profile, image_features
from cifar.data.neardup import NearDuplicates, find_near_duplicates, fingerprints
from cifar.io import atomic_write_bytes, atomic_write_json, read_json
from cifar.reuse import stage_key

logger = logging.getLogger("cifar.data")

HASH_BYTES = 8  # A 64-bit content hash: exact duplicates, and the rule that puts an added image in train or validation.
NEAR_MISS_MARGIN = 0.03  # The archive's pairs are kept down to threshold - margin: the contact sheet's near misses.


@dataclass(frozen=True)
class PartAnalysis:
    """Per image of one part: content hash, drift features and label."""

    hashes: np.ndarray  # (N,) uint64
    features: dict[str, np.ndarray]  # Feature name -> (N,) float32
    labels: np.ndarray  # (N,) int64

    def profile(self, keep: np.ndarray | None = None) -> Profile:
        """The part's drift profile (of the images in `keep` only, when given)."""
        if keep is None:
            return Profile.of(self.features, self.labels)
        return Profile.of({name: values[keep] for name, values in self.features.items()}, self.labels[keep])

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, hashes=self.hashes, labels=self.labels, **self.features)
        return buffer.getvalue()

    @classmethod
    def from_file(cls, path: Path) -> PartAnalysis:
        with np.load(path, allow_pickle=False) as arrays:
            return cls(
                hashes=arrays["hashes"], features={name: arrays[name] for name in FEATURES}, labels=arrays["labels"]
            )


def image_hashes(images: np.ndarray) -> np.ndarray:
    """BLAKE2b-64 of each image's 3,072 bytes (HWC), as uint64: same pixels, same hash."""
    rows = np.ascontiguousarray(images, np.uint8).reshape(len(images), -1)
    return np.array(
        [int.from_bytes(hashlib.blake2b(row.data, digest_size=HASH_BYTES).digest(), "little") for row in rows],
        dtype=np.uint64,
    )


def analyse(images: np.ndarray, labels: np.ndarray) -> PartAnalysis:
    return PartAnalysis(hashes=image_hashes(images), features=image_features(images), labels=np.asarray(labels))


def analysis_key(content: str, near_duplicate_similarity: float) -> str:
    """The key of an analysis: the content it describes, the threshold and this module's code."""
    return stage_key("analysis", content=content, near_duplicate_similarity=near_duplicate_similarity)


@dataclass(frozen=True)
class BaseAnalysis:
    """The base archive's analysis: both batches, its test fingerprints, its test images' near-duplicates."""

    train: PartAnalysis
    test: PartAnalysis
    test_fingerprints: np.ndarray  # (N_test, DIMENSIONS) float32
    pairs: NearDuplicates  # query = test index, pool = training index, down to threshold - NEAR_MISS_MARGIN
    threshold: float

    @property
    def near_duplicates(self) -> NearDuplicates:
        """The archive's test images' near-duplicates in its training batches, at the threshold."""
        return self.pairs.at(self.threshold)


def base_analysis(
    workdir: Path, archive_sha256: str, dataset: RawDataset | Callable[[], RawDataset], threshold: float
) -> BaseAnalysis:
    """The base archive's analysis from the cache, or computed (and kept) when missing.

    `dataset` is the archive's content, or a function that reads it (called only when not cached).
    """
    key = analysis_key(archive_sha256, threshold)
    directory = Path(workdir) / "data" / "bases" / f"{archive_sha256[:16]}-{key}"
    lock = Path(workdir) / ".locks" / "data" / f"base-{archive_sha256[:16]}-{key}.lock"
    with locks.exclusive(lock, f"the analysis of archive {archive_sha256[:12]}"):
        cached = _load_base(directory, threshold)
        if cached is not None:
            return cached
        logger.info("Analysing the archive's images (hashes, statistics, near-duplicates of test images)")
        dataset = dataset() if callable(dataset) else dataset
        train = analyse(dataset.train_images, dataset.train_labels)
        test = analyse(dataset.test_images, dataset.test_labels)
        test_fingerprints = fingerprints(dataset.test_images)[:, 0]
        pairs = find_near_duplicates(dataset.test_images, dataset.train_images, threshold - NEAR_MISS_MARGIN)
        found = len(pairs.at(threshold).queries())
        logger.info("%d test images have a near-duplicate in the training batches", found)
        atomic_write_bytes(directory / "train.npz", train.to_bytes())
        atomic_write_bytes(directory / "test.npz", test.to_bytes())
        buffer = io.BytesIO()
        np.save(buffer, test_fingerprints, allow_pickle=False)
        atomic_write_bytes(directory / "test_fingerprints.npy", buffer.getvalue())
        atomic_write_json(directory / "near_duplicates.json", pairs.model_dump())  # Written last: the commit point.
        return BaseAnalysis(train, test, test_fingerprints, pairs, threshold)


def _load_base(directory: Path, threshold: float) -> BaseAnalysis | None:
    if not (directory / "near_duplicates.json").is_file():
        return None
    try:
        return BaseAnalysis(
            train=PartAnalysis.from_file(directory / "train.npz"),
            test=PartAnalysis.from_file(directory / "test.npz"),
            test_fingerprints=np.load(directory / "test_fingerprints.npy", allow_pickle=False),
            pairs=NearDuplicates.model_validate(read_json(directory / "near_duplicates.json")),
            threshold=threshold,
        )
    except (OSError, ValueError, KeyError) as error:
        logger.warning("Recomputing the archive's analysis in %s: %s", directory, error)
        return None


def addition_analysis(addition_dir: Path, digest: str, images: np.ndarray, labels: np.ndarray, threshold: float):
    """An addition's analysis, from beside it in the store or computed and kept there."""
    path = Path(addition_dir) / f"analysis-{analysis_key(digest, threshold)}.npz"
    if path.is_file():
        try:
            return PartAnalysis.from_file(path)
        except (OSError, ValueError, KeyError) as error:
            logger.warning("Recomputing %s: %s", path, error)
    analysis = analyse(images, labels)
    if Path(addition_dir).is_dir():
        atomic_write_bytes(path, analysis.to_bytes())
    return analysis
