"""The data stage: archive in, verified TFRecord shards + manifest + statistics out, or the finished ones reused.

    fetch (verify checksums) -> read (safe, restricted unpickler) -> validate -> convert (shards)
    -> statistics -> manifest, all into a temp directory renamed to WORKDIR/data/cifar10-<key>.

`<key>` is the stage's key (`cifar.reuse.data_key`): the archive's SHA-256, the settings that shape
the shards, the format version and the data code's version. When that directory already holds a
complete manifest with that key whose shards have their recorded sizes, nothing is converted again;
`verify_data_dir` re-hashes every shard when that cheap check is not enough. A partial or damaged
directory is removed and rebuilt, never returned.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cifar import failpoints, locks
from cifar.config import DataConfig, resolve_workdir
from cifar.data.archive import RawDataset, read_archive
from cifar.data.convert import SPLITS, convert_dataset
from cifar.data.download import fetch_archive
from cifar.data.manifest import MANIFEST_NAME, Manifest, SourceInfo, load_manifest, write_manifest
from cifar.data.stats import channel_statistics, write_class_histogram, write_statistics
from cifar.data.validate import validate_dataset
from cifar.io import atomic_directory, file_digest
from cifar.results import ArchiveInfo, DataResult
from cifar.reuse import data_key, data_settings
from cifar.workdir import data_root, downloads_dir

logger = logging.getLogger("cifar.data")

ProgressCallback = Callable[[str, float], None]

# Each step's share of the whole stage, for the progress callback (fractions of the stage, 0..1).
STEP_SPANS = {
    "fetch": (0.0, 0.1),
    "read": (0.1, 0.35),
    "validate": (0.35, 0.4),
    "convert": (0.4, 0.95),
    "statistics": (0.95, 1.0),
}


class IncompleteDataError(ValueError):
    """A data directory is missing files, or a file differs from what its manifest records."""


def _report(callback: ProgressCallback | None, step: str, step_fraction: float) -> None:
    """Maps (step, fraction of that step) to a fraction of the whole stage for the caller's callback."""
    start, stop = STEP_SPANS.get(step, (1.0, 1.0))
    if callback is not None:
        callback(step, start + (stop - start) * min(max(step_fraction, 0.0), 1.0))


def prepare_data(
    config: DataConfig,
    workdir: str | Path,
    archive: ArchiveInfo | None = None,
    *,
    refresh: bool = False,
    progress: ProgressCallback | None = None,
) -> DataResult:
    """Converts the verified archive into WORKDIR/data/cifar10-<key>, or reuses the finished directory.

    `archive` is the download stage's verified archive; without it the archive is fetched and
    verified first (for a caller outside the pipeline). `refresh` rebuilds a finished directory.
    `progress(step, fraction)` gets the current step and the fraction (0..1) of the stage done.
    """
    workdir = resolve_workdir(workdir)
    report = functools.partial(_report, progress)
    archive = archive or _fetch(config, workdir, report)
    key = data_key(config, archive.sha256)
    data_dir = data_root(workdir) / f"cifar10-{key}"

    remove_abandoned_partials(data_root(workdir))
    # One run builds a key's directory; another run of the same key waits here, then reuses it.
    with locks.exclusive(locks.lock_path(data_dir), f"the data directory {data_dir.name}"):
        manifest = None if refresh else reusable_manifest(data_dir, key)
        if manifest is not None:
            logger.info("Reusing %s (same archive, settings and code)", data_dir)
            report("done", 1.0)
            return _result(data_dir, manifest, reused=True)
        if data_dir.exists():
            logger.warning("Removing %s before rebuilding it", data_dir)
            shutil.rmtree(data_dir)
        started = time.perf_counter()
        report("read", 0.0)
        logger.info("Reading %s", archive.path)
        dataset = read_archive(archive.path)
        num_train, num_test = len(dataset.train_images), len(dataset.test_images)
        logger.info("Read %s layout: %d training and %d test images", dataset.layout, num_train, num_test)
        with atomic_directory(data_dir) as temp:
            manifest = _build(temp, dataset, archive, config, key, report)
            failpoints.reached("data.converted")
    logger.info("Data stage wrote %s in %.1f s", data_dir, time.perf_counter() - started)
    report("done", 1.0)
    return _result(data_dir, manifest, reused=False)


def remove_abandoned_partials(root: Path) -> None:
    """Deletes the temp directories of data stages that died (`.cifar10-<key>.*.partial` whose key nobody holds)."""
    for partial in root.glob(".cifar10-*.partial"):
        if not locks.is_held(locks.lock_path(root / partial.name.split(".")[1])):
            logger.warning("Removing %s, left by a data stage that did not finish", partial)
            shutil.rmtree(partial, ignore_errors=True)


def _fetch(config: DataConfig, workdir: Path, report: ProgressCallback) -> ArchiveInfo:
    """Downloads (or locates) and verifies the archive."""
    report("fetch", 0.0)
    logger.info("Fetching and verifying %s", config.source)
    archive = fetch_archive(
        config.source,
        downloads_dir(workdir),
        sha256=config.sha256,
        md5=config.expected_md5(),
        retries=config.download_retries,
        progress=lambda done, total: report("fetch", done / total) if total else None,
    )
    logger.info("Archive %s verified (sha256 %s)", archive.path, archive.sha256)
    report("fetch", 1.0)
    return archive


def _build(
    output_dir: Path, dataset: RawDataset, archive: ArchiveInfo, config: DataConfig, key: str, report: ProgressCallback
) -> Manifest:
    """Validates, converts and summarises the dataset into `output_dir`; returns the manifest."""
    report("validate", 0.0)
    validate_dataset(dataset, config)

    report("convert", 0.0)

    def on_shard(written: int, total: int) -> None:
        logger.info("Converting: %d of %d shards written", written, total)
        report("convert", written / total)

    train_images = dataset.train_images[: len(dataset.train_images) - config.validation_size]
    with ThreadPoolExecutor(max_workers=1) as executor:
        # The statistics (numpy, which releases the GIL) are computed while the shards are written.
        statistics = executor.submit(channel_statistics, train_images)
        splits = convert_dataset(dataset, config, output_dir, on_shard=on_shard)
        report("statistics", 0.0)
        mean, std = statistics.result()
    logger.info(
        "Training split mean %s, std %s", [round(value, 4) for value in mean], [round(value, 4) for value in std]
    )
    write_statistics(output_dir, mean, std, splits["train"].num_examples)
    write_class_histogram(output_dir, splits, dataset.class_names)
    manifest = Manifest(
        key=key,
        source=SourceInfo(location=config.source, sha256=archive.sha256, md5=archive.md5, layout=dataset.layout),
        class_names=dataset.class_names,
        settings=data_settings(config),
        splits=splits,
        mean=mean,
        std=std,
    )
    write_manifest(output_dir, manifest)
    # The temp directory and the manifest are created private (0700 / 0600); the data is readable by
    # the other processes (training, serving) like any other output file.
    os.chmod(output_dir, 0o755)
    os.chmod(output_dir / MANIFEST_NAME, 0o644)
    report("statistics", 1.0)
    return manifest


def _result(data_dir: Path, manifest: Manifest, *, reused: bool) -> DataResult:
    return DataResult(
        key=manifest.key,
        data_dir=str(data_dir),
        manifest_path=str(data_dir / MANIFEST_NAME),
        source_sha256=manifest.source.sha256,
        reused=reused,
        counts={split: manifest.splits[split].num_examples for split in SPLITS},
    )


# Checking a finished directory.


def _check_data_dir(data_dir: str | Path, *, check_digests: bool) -> Manifest:
    """The manifest, after checking every file it names exists with its size (and SHA-256, if asked)."""
    data_dir = Path(data_dir)
    try:
        manifest = load_manifest(data_dir)
    except (OSError, ValueError) as error:
        raise IncompleteDataError(f"{data_dir}: no readable manifest: {error}") from error
    missing_splits = [split for split in SPLITS if split not in manifest.splits]
    if missing_splits:
        raise IncompleteDataError(f"{data_dir}: manifest lacks splits {missing_splits}")
    for split in SPLITS:
        entry = manifest.splits[split]
        if sum(shard.num_examples for shard in entry.shards) != entry.num_examples:
            raise IncompleteDataError(f"{data_dir}: {split} shards do not add up to {entry.num_examples} examples")
        for shard in entry.shards:
            path = data_dir / shard.path
            if not path.is_file():
                raise IncompleteDataError(f"{data_dir}: shard {shard.path} is missing")
            size = path.stat().st_size
            if shard.num_bytes is not None and size != shard.num_bytes:
                raise IncompleteDataError(
                    f"{data_dir}: shard {shard.path} has {size:,} bytes, manifest says {shard.num_bytes:,}"
                )
            if check_digests and (actual := file_digest(path)) != shard.sha256:
                raise IncompleteDataError(
                    f"{data_dir}: shard {shard.path} has sha256 {actual}, manifest says {shard.sha256}"
                )
    for name in (manifest.statistics_file, manifest.class_histogram_file):
        if not (data_dir / name).is_file():
            raise IncompleteDataError(f"{data_dir}: {name} is missing")
    return manifest


def verify_data_dir(data_dir: str | Path) -> None:
    """Re-hashes every shard of a data directory; raises IncompleteDataError on any missing or changed file."""
    _check_data_dir(data_dir, check_digests=True)


def reusable_manifest(data_dir: str | Path, key: str) -> Manifest | None:
    """The manifest of a complete directory made under `key` (cheap check: sizes, not digests), else None."""
    if not os.path.isdir(data_dir):
        return None
    try:
        manifest = _check_data_dir(data_dir, check_digests=False)
    except IncompleteDataError as error:
        logger.warning("Not reusing %s: %s", data_dir, error)
        return None
    if manifest.key != key:
        logger.warning("Not reusing %s: it was built under another key", data_dir)
        return None
    return manifest
