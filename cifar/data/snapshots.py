"""Versioned data: the base archive plus the additions ingested into a workdir, as content-addressed snapshots.

The store's layout, the keys (`cifar.reuse.snapshot_key`: the same parts are the same snapshot, in
whatever order they arrived) and the commands: docs/DATA.md ("The store"). Every write is atomic and
changes to the snapshot records take a lock, so ingests running at once each extend the latest in turn.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from cifar import locks
from cifar.config import DataConfig
from cifar.data.additions import Addition, FileProblem
from cifar.data.analysis import PartAnalysis, addition_analysis
from cifar.data.manifest import NUM_CLASSES
from cifar.io import atomic_directory, atomic_write_json, read_json
from cifar.reuse import snapshot_key
from cifar.workdir import data_root

ADDITION_RECORD = "addition.json"
BASE_SNAPSHOT = "base"  # `data.snapshot=base`: the archive alone.
LATEST_SNAPSHOT = "latest"


class SnapshotNotFoundError(ValueError):
    """The snapshot asked for is not in this workdir's store (or belongs to another base archive)."""


class AdditionRecord(BaseModel):
    """What an ingested addition holds and where it came from."""

    model_config = ConfigDict(extra="forbid")

    digest: str
    kind: str  # "folder" or "batch_file"
    source: str
    resize: str | None
    count: int
    class_counts: list[int]
    names: list[str]  # Per image, in stored order: its file or `<batch file>#<row>`.
    problems: list[FileProblem]  # Files left out when the addition was read.
    ingested_at: str

    @classmethod
    def of(cls, addition: Addition) -> AdditionRecord:
        return cls(
            digest=addition.digest,
            kind=addition.kind,
            source=addition.source,
            resize=addition.resize,
            count=len(addition.labels),
            class_counts=[int(value) for value in np.bincount(addition.labels, minlength=NUM_CLASSES)[:NUM_CLASSES]],
            names=list(addition.names),
            problems=list(addition.problems),
            ingested_at=now(),
        )


class SnapshotRecord(BaseModel):
    """A snapshot: a base archive plus additions (digests, sorted), and the snapshot it was made from."""

    model_config = ConfigDict(extra="forbid")

    key: str
    base_sha256: str
    base_source: str
    additions: list[str] = []
    parent: str | None = None
    created_at: str
    change: str  # What made it: "base archive", "added <digest>", "removed <digest>".


@dataclass(frozen=True)
class StoredPart:
    """An addition as the store holds it: its record, its arrays and their analysis."""

    record: AdditionRecord
    images: np.ndarray  # (N, 32, 32, 3) uint8
    labels: np.ndarray  # (N,) int64
    analysis: PartAnalysis

    @property
    def digest(self) -> str:
        return self.record.digest


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class DataStore:
    """The snapshot store of one workdir (see the module docstring for its layout)."""

    def __init__(self, workdir: str | Path) -> None:
        self.workdir = Path(workdir)
        self.root = data_root(self.workdir)
        self.additions_dir = self.root / "additions"
        self.snapshots_dir = self.root / "snapshots"
        self.rejected_dir = self.root / "rejected"

    # Additions.

    def addition_dir(self, digest: str) -> Path:
        return self.additions_dir / digest

    def has_addition(self, digest: str) -> bool:
        return (self.addition_dir(digest) / ADDITION_RECORD).is_file()

    def write_addition(self, addition: Addition) -> AdditionRecord:
        """Stores an addition under its digest (atomically; an addition already stored is left as it is)."""
        digest = addition.digest
        record = AdditionRecord.of(addition)
        target = self.addition_dir(digest)
        with locks.exclusive(self._lock("addition-" + digest[:16]), f"the addition {digest[:12]}"):
            if self.has_addition(digest):
                return self.addition(digest)
            with atomic_directory(target) as temp:
                np.save(temp / "images.npy", np.ascontiguousarray(addition.images, np.uint8), allow_pickle=False)
                np.save(temp / "labels.npy", np.ascontiguousarray(addition.labels, np.int64), allow_pickle=False)
                atomic_write_json(temp / ADDITION_RECORD, record.model_dump(mode="json"))
                os.chmod(temp, 0o755)
        return record

    def addition(self, digest: str) -> AdditionRecord:
        try:
            return AdditionRecord.model_validate(read_json(self.addition_dir(digest) / ADDITION_RECORD))
        except FileNotFoundError:
            raise SnapshotNotFoundError(f"addition {digest} is not in the store {self.additions_dir}") from None

    def addition_arrays(self, digest: str) -> tuple[np.ndarray, np.ndarray]:
        """(images (N, 32, 32, 3) uint8, labels (N,) int64) of a stored addition, checked against its digest."""
        directory = self.addition_dir(digest)
        images = np.load(directory / "images.npy", allow_pickle=False)
        labels = np.load(directory / "labels.npy", allow_pickle=False)
        stored = Addition(images=images, labels=labels, names=[], kind="", source="")
        if stored.digest != digest:
            raise ValueError(f"the stored addition {directory} does not match its digest: it was changed on disk")
        return images, labels

    def part(self, digest: str, near_duplicate_similarity: float) -> StoredPart:
        """A stored addition with its arrays (digest-checked) and its analysis (kept beside it)."""
        images, labels = self.addition_arrays(digest)
        analysis = addition_analysis(self.addition_dir(digest), digest, images, labels, near_duplicate_similarity)
        return StoredPart(self.addition(digest), images, labels, analysis)

    # Snapshots.

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Holds the store's lock while snapshot records change (one ingest at a time extends `latest`).

        Re-entrant within a thread: an ingest that holds it may record the base snapshot.
        """
        with locks.reentrant(self._lock("snapshots"), "the data snapshot store"):
            yield

    def _lock(self, name: str) -> Path:
        return self.workdir / ".locks" / "data" / f"{name}.lock"

    def snapshot(self, key: str) -> SnapshotRecord:
        path = self.snapshots_dir / f"{key}.json"
        if not path.is_file():
            raise SnapshotNotFoundError(
                f"no snapshot {key} in {self.snapshots_dir} (list them: python flows/ingest.py --list)"
            )
        return SnapshotRecord.model_validate(read_json(path))

    def snapshots(self) -> list[SnapshotRecord]:
        """Every snapshot, oldest first."""
        if not self.snapshots_dir.is_dir():
            return []
        records = [
            SnapshotRecord.model_validate(read_json(path))
            for path in self.snapshots_dir.glob("*.json")
            if not path.name.startswith("latest-") and not path.name.endswith(".validation.json")
        ]
        return sorted(records, key=lambda record: (record.created_at, record.key))

    def latest(self, base_sha256: str) -> SnapshotRecord | None:
        path = self._latest_path(base_sha256)
        return self.snapshot(read_json(path)["key"]) if path.is_file() else None

    def _latest_path(self, base_sha256: str) -> Path:
        return self.snapshots_dir / f"latest-{base_sha256[:16]}.json"

    def record(
        self, base_sha256: str, base_source: str, additions: list[str], change: str, *, make_latest: bool = True
    ) -> SnapshotRecord:
        """Writes (or finds) the snapshot of these parts, by default as the base's latest. Call it `changing()`."""
        key = snapshot_key(base_sha256, additions)
        latest = self.latest(base_sha256)
        path = self.snapshots_dir / f"{key}.json"
        if path.is_file():
            record = self.snapshot(key)
        else:
            record = SnapshotRecord(
                key=key,
                base_sha256=base_sha256,
                base_source=base_source,
                additions=sorted(set(additions)),
                parent=latest.key if latest is not None and latest.key != key else None,
                created_at=now(),
                change=change,
            )
            atomic_write_json(path, record.model_dump(mode="json"))
        if make_latest or latest is None:
            atomic_write_json(self._latest_path(base_sha256), {"key": key})
        return record

    def base_snapshot(self, base_sha256: str, base_source: str) -> SnapshotRecord:
        """The snapshot of the archive alone: its record when there is one, else a new one (not written yet)."""
        key = snapshot_key(base_sha256, [])
        if (self.snapshots_dir / f"{key}.json").is_file():
            return self.snapshot(key)
        return SnapshotRecord(
            key=key, base_sha256=base_sha256, base_source=base_source, created_at=now(), change="base archive"
        )

    def ensure_recorded(self, snapshot: SnapshotRecord) -> None:
        """Writes a snapshot's record if it has none yet (the base archive's, once its data was built or
        extended); it becomes its base's latest only when the base has none."""
        if (self.snapshots_dir / f"{snapshot.key}.json").is_file():
            return
        with self.changing():
            if not (self.snapshots_dir / f"{snapshot.key}.json").is_file():
                atomic_write_json(self.snapshots_dir / f"{snapshot.key}.json", snapshot.model_dump(mode="json"))
            if self.latest(snapshot.base_sha256) is None:
                atomic_write_json(self._latest_path(snapshot.base_sha256), {"key": snapshot.key})

    def resolve(self, requested: str, base_sha256: str, base_source: str) -> SnapshotRecord:
        """The snapshot `data.snapshot` names: latest (or the base when there is none yet), base, or a key.

        The base archive's snapshot is only recorded once its data is built (`ensure_recorded`).
        """
        if requested == LATEST_SNAPSHOT:
            return self.latest(base_sha256) or self.base_snapshot(base_sha256, base_source)
        if requested == BASE_SNAPSHOT:
            return self.base_snapshot(base_sha256, base_source)
        record = self.snapshot(requested)
        if record.base_sha256 != base_sha256:
            raise SnapshotNotFoundError(
                f"snapshot {requested} extends the archive with sha256 {record.base_sha256}, not the configured "
                f"{base_sha256}: set data.source and data.sha256 to that archive"
            )
        return record

    def newest_base(self) -> tuple[str, str] | None:
        """(source, sha256) of the archive of the snapshot recorded last, or None when there is none."""
        snapshots = self.snapshots()
        return (snapshots[-1].base_source, snapshots[-1].base_sha256) if snapshots else None

    def validation_report_path(self, key: str) -> Path:
        return self.snapshots_dir / f"{key}.validation.json"

    def rejected_report_path(self, digest: str) -> Path:
        return self.rejected_dir / f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{digest[:12]}.json"


def workdir_base(data: DataConfig, workdir: str | Path) -> DataConfig:
    """`data` with the workdir's archive (that of its newest snapshot) as the source, when it has one.

    For the flows that act on a workdir's data (ingest, retrain) when no archive was given: the base
    archive the workdir's snapshots extend, not the preset's default.
    """
    newest = DataStore(workdir).newest_base()
    if newest is None:
        return data
    source, sha256 = newest
    return data.model_copy(update={"source": source, "sha256": sha256, "md5": None})
