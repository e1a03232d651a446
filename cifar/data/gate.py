"""The data validation gate as the pipeline and ingestion run it: against which reference, on which new data.

The reference is the snapshot the champion was trained on, else the archive alone; the new data is
what the snapshot adds to it. `check_prepared` gates a prepared data directory (every data stage),
`check_candidate` the snapshot an addition would make (at ingestion, before anything is stored).
"""

from __future__ import annotations

from pathlib import Path

from cifar.champion import Champion
from cifar.config import PipelineConfig
from cifar.data.additions import Addition
from cifar.data.analysis import BaseAnalysis, analyse, base_analysis
from cifar.data.archive import RawDataset, read_archive
from cifar.data.gate_checks import DataValidationError, ValidationReport, run_checks
from cifar.data.manifest import load_manifest
from cifar.data.plan import SnapshotPlan, plan_snapshot, validation_share
from cifar.data.snapshots import AdditionRecord, DataStore, SnapshotNotFoundError, SnapshotRecord, StoredPart, now
from cifar.io import atomic_write_json, read_json
from cifar.reuse import snapshot_key


def choose_reference(
    store: DataStore, snapshot: SnapshotRecord, champion: Champion | None
) -> tuple[SnapshotRecord, str]:
    """The snapshot new data is compared with, and why that one."""
    base = store.base_snapshot(snapshot.base_sha256, snapshot.base_source)
    if champion is None:
        return base, "the base archive (no champion yet)"
    name = f"champion v{champion.version}"
    key = champion.trained_with.snapshot
    if key is None:
        return base, f"the base archive ({name} records no data snapshot)"
    try:
        record = store.snapshot(key)
    except SnapshotNotFoundError:
        return base, f"the base archive ({name}'s snapshot {key} is not in this workdir)"
    if record.base_sha256 != snapshot.base_sha256:
        return base, f"the base archive ({name} was trained on another archive)"
    return record, f"the training data of {name} (snapshot {key})"


def reference_profile(store: DataStore, reference: SnapshotRecord, base: BaseAnalysis, threshold: float):
    """(profile, training examples) of the reference: the archive's training batches and its additions."""
    profile, examples = base.train.profile(), len(base.train.hashes)
    for digest in reference.additions:
        part = store.part(digest, threshold)
        profile, examples = profile + part.analysis.profile(), examples + len(part.labels)
    return profile, examples


def _gate(
    store: DataStore,
    snapshot: SnapshotRecord,
    parts: list[StoredPart],
    plan: SnapshotPlan,
    base: BaseAnalysis,
    champion: Champion | None,
    config: PipelineConfig,
) -> ValidationReport:
    reference, reason = choose_reference(store, snapshot, champion)
    threshold = config.data.near_duplicate_similarity
    profile, examples = reference_profile(store, reference, base, threshold)
    new_parts = [part for part in parts if part.digest not in set(reference.additions)]
    return run_checks(snapshot.key, reference.key, reason, new_parts, plan, profile, examples, config.validate)


def check_prepared(
    config: PipelineConfig, data_dir: str | Path, archive_path: str, workdir: str | Path, champion: Champion | None
) -> tuple[ValidationReport, Path]:
    """The gate on a prepared data directory's snapshot; the report is written beside its manifest."""
    data_dir, store = Path(data_dir), DataStore(workdir)
    manifest = load_manifest(data_dir)
    if manifest.snapshot is None or manifest.plan_file is None:
        raise ValueError(f"{data_dir} was prepared without a snapshot: run the data stage again")
    snapshot = store.snapshot(manifest.snapshot.key)
    threshold = config.data.near_duplicate_similarity
    base = base_analysis(
        Path(workdir), snapshot.base_sha256, lambda: read_archive(archive_path, all_batches=False), threshold
    )
    parts = [store.part(digest, threshold) for digest in snapshot.additions]
    plan = SnapshotPlan.model_validate(read_json(data_dir / manifest.plan_file))
    report = _gate(store, snapshot, parts, plan, base, champion, config)
    path = atomic_write_json(data_dir / f"validation-{report.reference}.json", report.model_dump(mode="json"))
    return report, path


def check_candidate(
    config: PipelineConfig,
    addition: Addition,
    latest: SnapshotRecord,
    dataset: RawDataset,
    workdir: str | Path,
    champion: Champion | None,
) -> tuple[ValidationReport, SnapshotRecord]:
    """The gate on the snapshot `addition` would make (latest + addition), before anything is stored.

    `dataset` is the base archive's content. Returns the report and the candidate snapshot's record
    (not written).
    """
    store, threshold = DataStore(workdir), config.data.near_duplicate_similarity
    base = base_analysis(Path(workdir), latest.base_sha256, dataset, threshold)
    digest = addition.digest
    record = AdditionRecord.of(addition)
    new_part = StoredPart(record, addition.images, addition.labels, analyse(addition.images, addition.labels))
    parts = [store.part(item, threshold) for item in latest.additions if item != digest] + [new_part]
    additions = sorted({part.digest for part in parts})
    candidate = SnapshotRecord(
        key=snapshot_key(latest.base_sha256, additions),
        base_sha256=latest.base_sha256,
        base_source=latest.base_source,
        additions=additions,
        parent=latest.key,
        created_at=now(),
        change=f"added {digest}",
    )
    fraction = validation_share(config.data.validation_size, len(dataset.train_images))
    plan = plan_snapshot(
        candidate.key, parts, base, dataset.test_images, validation_fraction=fraction, threshold=threshold
    )
    return _gate(store, candidate, parts, plan, base, champion, config), candidate


def enforce_report(report: ValidationReport, report_path: Path | str) -> None:
    """Raises DataValidationError when a check failed and the gate is enforced."""
    if not report.passed and report.enforce:
        raise DataValidationError(report, str(report_path))
