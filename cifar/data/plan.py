"""Where each image of a snapshot's additions goes: training, validation, or out (a duplicate, a test leak).

The base archive is never changed: its training batches split as before (the last `validation_size`
images validate) and its test batch is the test split of every snapshot, so models of different
snapshots are compared on identical images. Each addition, in the snapshot's canonical order (by
digest), image by image in stored order:

1. an exact duplicate (same pixels) of an image seen before (the archive's, an earlier addition's, or
   earlier in the same addition) is dropped; a copy of a *test* image is a leak;
2. a near-duplicate of a test image (cifar.data.neardup) is a leak, kept out of training and listed;
3. every other image goes to validation when its content hash, read as a fraction of 2^64, is below
   the archive's validation share (validation_size / training images), else to training: a rule on
   the image's own content, so an image never moves when more data arrives. The validation images
   of additions also form the `new_data` slice that evaluation reports on its own.

The same parts always give the same plan, so the same snapshot always builds the same shards.
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
    """The content rule: an image validates when its hash, as a fraction of 2^64, is below `fraction`."""
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
    """The plan of a snapshot's additions (given in any order) against the base archive."""
    seen: dict[int, tuple[str, int]] = {}  # Hash -> (what it is, its label).
    for index, (value, label) in enumerate(zip(base.train.hashes.tolist(), base.train.labels.tolist())):
        seen.setdefault(value, (f"training image {index} of the archive", label))
    test_hashes = {value: index for index, value in enumerate(base.test.hashes.tolist())}
    for index, (value, label) in enumerate(zip(base.test.hashes.tolist(), base.test.labels.tolist())):
        seen.setdefault(value, (f"test image {index}", label))
    plan = SnapshotPlan(snapshot=snapshot, validation_fraction=validation_fraction)
    for part in sorted(additions, key=lambda item: item.digest):
        digest, names, images, analysis = part.digest, part.record.names, part.images, part.analysis
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
            seen[value] = (f"{names[index]} of addition {digest[:12]}", label)
            remaining.append(index)
        remaining_index = np.asarray(remaining, np.int64)
        leaks = find_near_duplicates(images[remaining_index], test_images, threshold, pool_plain=base.test_fingerprints)
        leaked: dict[int, tuple[int, float]] = {}
        for query, test_index, similarity in zip(leaks.query, leaks.pool, leaks.similarity):
            leaked.setdefault(int(remaining_index[query]), (test_index, similarity))  # Most similar first.
        for index, (test_index, similarity) in sorted(leaked.items()):
            excluded.append(
                Exclusion(
                    index=index,
                    name=names[index],
                    reason="leakage",
                    of=f"test image {test_index}",
                    similarity=similarity,
                )
            )
        kept = np.asarray([index for index in remaining if index not in leaked], np.int64)
        to_validation = goes_to_validation(analysis.hashes[kept], validation_fraction) if len(kept) else kept
        plan.parts.append(
            PartPlan(
                digest=digest,
                count=len(analysis.hashes),
                train=kept[~to_validation].tolist() if len(kept) else [],
                validation=kept[to_validation].tolist() if len(kept) else [],
                excluded=sorted(excluded, key=lambda item: item.index),
            )
        )
    return plan
