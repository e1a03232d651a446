"""Tasks of the data stage: verify the archive, pick the data snapshot, convert it into shards, then gate it."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from cifar.config import PipelineConfig
from cifar.data.download import fetch_archive
from cifar.data.prepare import prepare_data, reusable_manifest
from cifar.data.snapshots import DataStore, SnapshotRecord
from cifar.results import ArchiveInfo, DataResult
from cifar.reuse import data_key
from cifar.workdir import downloads_dir
from tasks.artifacts import ProgressReporter
from tasks.caching import stage_task


# Not cached: the archive's digest is the data stage's key, so it is computed every run (a local
# file may have been replaced). No Prefect retries either: fetch_archive retries transient network
# faults itself and fails at once on faults that waiting cannot heal.
@task(name="download")
def download_archive(config: PipelineConfig, workdir: str) -> ArchiveInfo:
    """Downloads the archive (or finds a local one) and verifies its checksum."""
    data = config.data
    progress = ProgressReporter("download", f"Download of {data.source}")
    archive = fetch_archive(
        data.source,
        downloads_dir(Path(workdir)),
        sha256=data.sha256,
        md5=data.expected_md5(),
        retries=data.download_retries,
        progress=progress.bytes,
    )
    progress.finish()
    return archive


# Not cached: `latest` moves whenever an addition is ingested, and reading two small files is free.
@task(name="snapshot")
def resolve_snapshot(config: PipelineConfig, archive: ArchiveInfo, workdir: str) -> SnapshotRecord:
    """The data snapshot `data.snapshot` names: the archive plus the additions ingested into the workdir."""
    snapshot = DataStore(workdir).resolve(config.data.snapshot, archive.sha256, config.data.source)
    parts = f"{len(snapshot.additions)} additions" if snapshot.additions else "the archive alone"
    print(f"Data snapshot {snapshot.key} ({config.data.snapshot}): {parts}")
    return snapshot


@stage_task(
    "prepare",
    key_fn=lambda config, archive, snapshot, **_: data_key(config.data, archive.sha256, snapshot.additions),
    is_valid=lambda result: reusable_manifest(result.data_dir, result.key) is not None,
)
def prepare_dataset(
    config: PipelineConfig, archive: ArchiveInfo, snapshot: SnapshotRecord, workdir: str, refresh: bool = False
) -> DataResult:
    """Converts the snapshot (the verified archive and its additions) into shards, a manifest and statistics."""
    progress = ProgressReporter("prepare", f"Conversion of snapshot {snapshot.key} into TFRecord shards")
    result = prepare_data(config.data, workdir, archive, snapshot, refresh=refresh, progress=progress.step)
    progress.finish()
    return result
