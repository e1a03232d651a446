"""Tasks of the data stage: fetch and verify the archive, then convert it into TFRecord shards."""

from __future__ import annotations

from pathlib import Path

from prefect.tasks import exponential_backoff

from cifar.config import PipelineConfig
from cifar.data.download import ArchiveInfo, ChecksumMismatchError, fetch_archive
from cifar.data.prepare import DataResult, prepare_data
from cifar.io import file_digest
from cifar.workdir import downloads_dir
from tasks.artifacts import ProgressReporter
from tasks.caching import fingerprint, stage_key, stage_task


class Archive(ArchiveInfo):
    """A verified archive, plus a fingerprint of the file so a cached record notices it changed."""

    fingerprint: str


class Dataset(DataResult):
    """The data directory, the manifest's digest (its content identity) and a fingerprint of its files."""

    manifest_sha256: str
    fingerprint: str


def archive_key(config: PipelineConfig, **_) -> str:
    return stage_key("download", config)


def archive_is_valid(archive: Archive) -> bool:
    return fingerprint([archive.path], root="/") == archive.fingerprint


def dataset_key(config: PipelineConfig, archive: Archive, **_) -> str:
    return stage_key("data", config, {"archive_sha256": archive.sha256})


def dataset_is_valid(dataset: Dataset) -> bool:
    return fingerprint([dataset.data_dir]) == dataset.fingerprint


def retry_unless_invalid(task, task_run, state) -> bool:
    """Retries transient failures only: a checksum mismatch or a bad source fails at once."""
    error = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return not isinstance(error, (ChecksumMismatchError, ValueError, FileNotFoundError))


@stage_task(
    "download",
    key_fn=archive_key,
    is_valid=archive_is_valid,
    retries=3,
    retry_delay_seconds=exponential_backoff(backoff_factor=10),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_unless_invalid,
)
def download_archive(config: PipelineConfig, workdir: str) -> Archive:
    """Downloads the archive (or finds a local one) and verifies its checksum."""
    data = config.data
    progress = ProgressReporter("download", f"Download of {data.source}")
    info = fetch_archive(
        data.source, downloads_dir(Path(workdir)), sha256=data.sha256, md5=data.expected_md5(),
        retries=data.download_retries, progress=progress.bytes,
    )
    progress.finish()
    return Archive(**info.model_dump(), fingerprint=fingerprint([info.path], root="/"))


@stage_task("prepare", key_fn=dataset_key, is_valid=dataset_is_valid)
def prepare_dataset(config: PipelineConfig, archive: Archive, workdir: str) -> Dataset:
    """Converts the verified archive into TFRecord shards, a manifest and statistics."""
    progress = ProgressReporter("prepare", f"Conversion of {Path(archive.path).name} into TFRecord shards")
    result = prepare_data(config.data, workdir, progress=progress.step)
    progress.finish()
    return Dataset(
        **result.model_dump(),
        manifest_sha256=file_digest(result.manifest_path),
        fingerprint=fingerprint([result.data_dir]),
    )
