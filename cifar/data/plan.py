"""Where each image of a snapshot's additions goes: training, validation, or out (a duplicate, a test leak).

The base archive is never changed: its split stays as it was and its test batch is the test split of
every snapshot, so models of different snapshots are compared on identical images (docs/DATA.md,
"Splits that stay put").
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

from cifar.data.analysis import BaseAnalysis
from cifar.data.neardup import find_near_duplicates
from cifar.data.snapshots import StoredPart


class Exclusion(BaseModel):
    """One image of an addition kept out of the shards, and why."""

    model_config = ConfigDict(extra="forbid")

    index: int  # In the addition's stored order.
    name: str  # Its file, or `<batch file>#<row>`.
    reason: str  # "duplicate" or "leakage".
    of: str  # What it repeats: "test image 17", "training image 4 of the archive", "cat/2.png of addition 3fa2...".
    similarity: float | None = None  # Near-duplicate leaks: the similarity to that test image.
    conflicting_label: bool = False  # A duplicate whose label differs from its original's.


class PartPlan(BaseModel):
    """One addition's images: which train, which validate, which are out."""

    model_config = ConfigDict(extra="forbid")

    digest: str
    count: int
    train: list[int]
    validation: list[int]
    excluded: list[Exclusion]

    def excluded_for(self, reason: str) -> list[Exclusion]:
        return [item for item in self.excluded if item.reason == reason]


class SnapshotPlan(BaseModel):
    """The plan of every addition of a snapshot, in canonical (digest) order."""

    model_config = ConfigDict(extra="forbid")

    snapshot: str
    validation_fraction: float
    parts: list[PartPlan] = []

    def part(self, digest: str) -> PartPlan:
        return next(part for part in self.parts if part.digest == digest)


def validation_share(validation_size: int, base_train_examples: int) -> float:
    """The share of added images that validate: the archive's own (validation_size / training images)."""
    return validation_size / base_train_examples if base_train_examples else 0.0


def goes_to_validation(hashes: np.ndarray, fraction: float) -> np.ndarray:
    """The content rule: an image validates when its hash, as a fraction of 2^64, is below `fraction`.

    A rule on the image's own content, so an image never moves when more data arrives; the additions'
    validation images also form the `new_data` slice that evaluation reports on its own.
    """
    return hashes.astype(np.float64) / 2.0**64 < fraction


def plan_snapshot(
    snapshot: str,
    additions: list[StoredPart],
    base: BaseAnalysis,
    test_images: np.ndarray,
    *,
    validation_fraction: float,
    threshold: float,
) -> SnapshotPlan:
    """The plan of a snapshot's additions (given in any order) against the base archive.

    Each addition in the snapshot's canonical order (by digest), image by image in stored order: an exact
    duplicate of an image seen before is dropped (a copy of a test image is a leak), a near-duplicate of
    a test image is a leak, kept out and listed; every other image goes to validation or training by
    its own content hash. The same parts always give the same plan, so the same shards.
    """
    seen, test_hashes = _archive_hashes(base)
    plan = SnapshotPlan(snapshot=snapshot, validation_fraction=validation_fraction)
    for part in sorted(additions, key=lambda item: item.digest):
        excluded, remaining = _exact_duplicates(part, seen, test_hashes)
        leaked = _test_leaks(part, remaining, base, test_images, threshold)
        for index, (test_index, similarity) in sorted(leaked.items()):
            excluded.append(
                Exclusion(
                    index=index,
                    name=part.record.names[index],
                    reason="leakage",
                    of=f"test image {test_index}",
                    similarity=similarity,
                )
            )
        kept = np.asarray([index for index in remaining if index not in leaked], np.int64)
        to_validation = goes_to_validation(part.analysis.hashes[kept], validation_fraction) if len(kept) else kept
        plan.parts.append(
            PartPlan(
                digest=part.digest,
                count=len(part.analysis.hashes),
                train=kept[~to_validation].tolist() if len(kept) else [],
                validation=kept[to_validation].tolist() if len(kept) else [],
                excluded=sorted(excluded, key=lambda item: item.index),
            )
        )
    return plan


def _archive_hashes(base: BaseAnalysis) -> tuple[dict[int, tuple[str, int]], dict[int, int]]:
    """(hash -> (what the image is, its label) for every image of the archive, test hash -> test index)."""
    seen: dict[int, tuple[str, int]] = {}
    for index, (value, label) in enumerate(zip(base.train.hashes.tolist(), base.train.labels.tolist())):
        seen.setdefault(value, (f"training image {index} of the archive", label))
    test_hashes = {value: index for index, value in enumerate(base.test.hashes.tolist())}
    for index, (value, label) in enumerate(zip(base.test.hashes.tolist(), base.test.labels.tolist())):
        seen.setdefault(value, (f"test image {index}", label))
    return seen, test_hashes


def _exact_duplicates(
    part: StoredPart, seen: dict[int, tuple[str, int]], test_hashes: dict[int, int]
) -> tuple[list[Exclusion], list[int]]:
    """(the part's images that repeat one seen before, the indices of the others); adds the others to `seen`."""
    names, analysis = part.record.names, part.analysis
    excluded: list[Exclusion] = []
    remaining = []
    for index, (value, label) in enumerate(zip(analysis.hashes.tolist(), analysis.labels.tolist())):
        if value in seen:
            what, original_label = seen[value]
            reason = "leakage" if value in test_hashes else "duplicate"
            similarity = 1.0 if reason == "leakage" else None
            excluded.append(
                Exclusion(
                    index=index,
                    name=names[index],
                    reason=reason,
                    of=what,
                    similarity=similarity,
                    conflicting_label=label != original_label,
                )
            )
            continue
        seen[value] = (f"{names[index]} of addition {part.digest[:12]}", label)
        remaining.append(index)
    return excluded, remaining


def _test_leaks(
    part: StoredPart, remaining: list[int], base: BaseAnalysis, test_images: np.ndarray, threshold: float
) -> dict[int, tuple[int, float]]:
    """The part's remaining images that are near-duplicates of a test image: index -> (test index, similarity)."""
    remaining_index = np.asarray(remaining, np.int64)
    leaks = find_near_duplicates(
        part.images[remaining_index], test_images, threshold, pool_plain=base.test_fingerprints
    )
    leaked: dict[int, tuple[int, float]] = {}
    for query, test_index, similarity in zip(leaks.query, leaks.pool, leaks.similarity):
        leaked.setdefault(int(remaining_index[query]), (test_index, similarity))  # Most similar first.
    return leaked
