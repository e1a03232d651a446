"""Ingesting new labelled data: read it, gate it, store it under its digest, record the new snapshot.

    read (cifar.data.additions) -> gate the snapshot it would make (cifar.data.gate)
      -> passed (or validate.enforce false): store the addition, record latest + addition as the new latest
      -> failed: the report goes to WORKDIR/data/rejected/, the store is unchanged, DataValidationError

Ingests of one workdir take turns, each extending the latest snapshot (docs/DATA.md, "Commands").
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from cifar import failpoints
from cifar.champion import Champion
from cifar.config import PipelineConfig
from cifar.data.additions import read_addition
from cifar.data.archive import read_archive
from cifar.data.gate import check_candidate
from cifar.data.gate_checks import DataValidationError, ValidationReport
from cifar.data.snapshots import DataStore, SnapshotNotFoundError, SnapshotRecord
from cifar.io import atomic_write_json
from cifar.results import ArchiveInfo

logger = logging.getLogger("cifar.data")


class IngestResult(BaseModel):
    """What an ingest did: the addition, the snapshot it made (or found), the gate's verdict."""

    model_config = ConfigDict(extra="forbid")

    addition: str  # Digest.
    examples: int  # Usable images in the addition.
    left_out: int  # Files of the source that could not be used.
    snapshot: str  # The latest snapshot afterwards.
    previous: str | None  # The latest snapshot before.
    changed: bool  # False: the content was already in the latest snapshot.
    passed: bool | None = None  # The gate's verdict (None when nothing was checked).
    report_path: str | None = None
    summary: str


def latest_snapshot(store: DataStore, archive: ArchiveInfo) -> SnapshotRecord:
    """The latest snapshot of the archive, else the archive alone."""
    return store.latest(archive.sha256) or store.base_snapshot(archive.sha256, archive.source)


def ingest_addition(
    config: PipelineConfig,
    path: str | Path,
    workdir: str | Path,
    archive: ArchiveInfo,
    champion: Champion | None,
    *,
    resize: str | None = None,
) -> tuple[IngestResult, ValidationReport | None]:
    """Reads, gates and stores an addition; raises DataValidationError (store unchanged) when it fails."""
    store = DataStore(workdir)
    dataset = read_archive(archive.path, all_batches=False)  # The data stage checks the counts.
    addition = read_addition(path, dataset.class_names, resize=resize)
    digest = addition.digest
    left_out = len(addition.problems)
    usable = len(addition.labels)
    logger.info("Read %s: %d usable images, %d files left out (addition %s)", path, usable, left_out, digest)
    with store.changing():
        latest = latest_snapshot(store, archive)
        if digest in latest.additions:
            summary = f"nothing to do: addition {digest[:12]} is already in the latest snapshot {latest.key}"
            return IngestResult(
                addition=digest,
                examples=len(addition.labels),
                left_out=left_out,
                snapshot=latest.key,
                previous=latest.key,
                changed=False,
                summary=summary,
            ), None
        report, candidate = check_candidate(config, addition, latest, dataset, workdir, champion)
        if not report.passed and report.enforce:
            report_path = atomic_write_json(store.rejected_report_path(digest), report.model_dump(mode="json"))
            raise DataValidationError(report, str(report_path))
        store.write_addition(addition)
        failpoints.reached("ingest.stored")  # Stored, not yet a snapshot: an ingest again finishes the job.
        store.ensure_recorded(latest)  # The parent of the new snapshot, listed with it.
        record = store.record(latest.base_sha256, latest.base_source, candidate.additions, f"added {digest}")
        report_path = atomic_write_json(store.validation_report_path(record.key), report.model_dump(mode="json"))
    verdict = "passed" if report.passed else "failed, recorded anyway (validate.enforce is false)"
    summary = (
        f"added {len(addition.labels):,} images as {digest[:12]}: snapshot {latest.key} -> {record.key}; "
        f"validation {verdict}"
    )
    return IngestResult(
        addition=digest,
        examples=len(addition.labels),
        left_out=left_out,
        snapshot=record.key,
        previous=latest.key,
        changed=True,
        passed=report.passed,
        report_path=str(report_path),
        summary=summary,
    ), report


def remove_addition(workdir: str | Path, archive: ArchiveInfo, digest_prefix: str) -> IngestResult:
    """Records the latest snapshot without one addition (named by its digest or a prefix of 8+ characters).

    The addition's files stay in the store: older snapshots still use them.
    """
    store = DataStore(workdir)
    with store.changing():
        latest = latest_snapshot(store, archive)
        matches = [digest for digest in latest.additions if digest.startswith(digest_prefix.lower())]
        if len(digest_prefix) < 8 or len(matches) != 1:
            raise SnapshotNotFoundError(
                f"{digest_prefix!r} names {len(matches)} additions of the latest snapshot {latest.key} "
                "(give 8 or more characters of one digest; list them: python flows/ingest.py --list)"
            )
        remaining = [digest for digest in latest.additions if digest != matches[0]]
        store.ensure_recorded(latest)
        record = store.record(latest.base_sha256, latest.base_source, remaining, f"removed {matches[0]}")
    return IngestResult(
        addition=matches[0],
        examples=store.addition(matches[0]).count,
        left_out=0,
        snapshot=record.key,
        previous=latest.key,
        changed=True,
        summary=f"removed addition {matches[0][:12]}: snapshot {latest.key} -> {record.key}",
    )


def describe_snapshots(workdir: str | Path) -> str:
    """Every snapshot, oldest first, with what each adds: the text of `python flows/ingest.py --list`."""
    store = DataStore(workdir)
    snapshots = store.snapshots()
    if not snapshots:
        return f"no data snapshots in {store.snapshots_dir} yet (the first pipeline run or ingest records one)"
    latest = {record.base_sha256: store.latest(record.base_sha256) for record in snapshots}
    lines = []
    for record in snapshots:
        marker = " (latest)" if latest[record.base_sha256] and latest[record.base_sha256].key == record.key else ""
        examples = sum(store.addition(digest).count for digest in record.additions)
        lines.append(
            f"{record.key}{marker}  {record.created_at}  archive {record.base_sha256[:12]} + "
            f"{len(record.additions)} additions ({examples:,} images)  [{record.change}]"
        )
        for digest in record.additions:
            addition = store.addition(digest)
            classes = ", ".join(f"{index}:{count}" for index, count in enumerate(addition.class_counts) if count)
            what = f"{addition.count:>7,} images  {addition.kind}  {addition.source}"
            lines.append(f"    {digest[:12]}  {what}  [{classes}]")
    return "\n".join(lines)
