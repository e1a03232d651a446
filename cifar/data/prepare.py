"""The data stage: a data snapshot in, verified TFRecord shards, manifest and statistics out (or reused).

    fetch (verify checksums) -> read (safe, restricted unpickler) -> validate -> plan the additions
    -> convert (shards) -> statistics -> manifest, all into a temp directory renamed to
    WORKDIR/data/cifar10-<key>.

A complete directory under the same key (`cifar.reuse.data_key`) is reused; a partial one is rebuilt.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from cifar import failpoints, locks, plots
from cifar.config import DataConfig, resolve_workdir
from cifar.data.analysis import BaseAnalysis, base_analysis
from cifar.data.archive import RawDataset, read_archive, validate_dataset
from cifar.data.convert import SPLITS, convert_splits, split_dataset
from cifar.data.download import fetch_archive
from cifar.data.manifest import (
    MANIFEST_NAME,
    NEAR_DUPLICATES_FILE,
    NEAR_DUPLICATES_SHEET,
    NEW_DATA_SLICE,
    PLAN_FILE,
    Manifest,
    SliceInfo,
    SnapshotInfo,
    SourceInfo,
    load_manifest,
    write_manifest,
)
from cifar.data.neardup import NearDuplicates
from cifar.data.plan import SnapshotPlan, plan_snapshot, validation_share
from cifar.data.snapshots import DataStore, SnapshotRecord, StoredPart
from cifar.data.stats import channel_statistics, write_class_histogram, write_statistics
from cifar.io import atomic_directory, atomic_write_bytes, atomic_write_json, file_digest
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
    snapshot: SnapshotRecord | None = None,
    *,
    refresh: bool = False,
    progress: ProgressCallback | None = None,
) -> DataResult:
    """Converts a snapshot (the verified archive plus its additions) into WORKDIR/data/cifar10-<key>, or reuses it.

    `archive` is the download stage's verified archive; without it the archive is fetched and
    verified first (for a caller outside the pipeline). `snapshot` is the snapshot to build; without
    it, the one `config.snapshot` names. `refresh` rebuilds a finished directory.
    `progress(step, fraction)` gets the current step and the fraction (0..1) of the stage done.
    """
    workdir = resolve_workdir(workdir)
    report = functools.partial(_report, progress)
    archive = archive or _fetch(config, workdir, report)
    store = DataStore(workdir)
    snapshot = snapshot or store.resolve(config.snapshot, archive.sha256, config.source)
    key = data_key(config, archive.sha256, snapshot.additions)
    data_dir = data_root(workdir) / f"cifar10-{key}"

    remove_abandoned_partials(data_root(workdir))
    # One run builds a key's directory; another run of the same key waits here, then reuses it.
    with locks.exclusive(locks.lock_path(data_dir), f"the data directory {data_dir.name}"):
        manifest = None if refresh else reusable_manifest(data_dir, key)
        if manifest is not None:
            logger.info("Reusing %s (same snapshot, settings and code)", data_dir)
            store.ensure_recorded(snapshot)
            report("done", 1.0)
            return _result(data_dir, manifest, reused=True)
        if data_dir.exists():
            logger.warning("Removing %s before rebuilding it", data_dir)
            shutil.rmtree(data_dir)
        started = time.perf_counter()
        report("read", 0.0)
        logger.info("Reading %s", archive.path)
        dataset = read_archive(archive.path, all_batches=config.expect_official_counts)
        num_train, num_test = len(dataset.train_images), len(dataset.test_images)
        logger.info("Read %s layout: %d training and %d test images", dataset.layout, num_train, num_test)
        parts = [store.part(digest, config.near_duplicate_similarity) for digest in snapshot.additions]
        with atomic_directory(data_dir) as temp:
            manifest = _build(temp, dataset, parts, archive, snapshot, config, key, workdir, report)
            failpoints.reached("data.converted")
        store.ensure_recorded(snapshot)
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
    output_dir: Path,
    dataset: RawDataset,
    parts: list[StoredPart],
    archive: ArchiveInfo,
    snapshot: SnapshotRecord,
    config: DataConfig,
    key: str,
    workdir: Path,
    report: ProgressCallback,
) -> Manifest:
    """Validates, plans, converts and summarises the snapshot into `output_dir`; returns the manifest."""
    report("validate", 0.0)
    validate_dataset(dataset, config)

    def on_shard(written: int, total: int) -> None:
        logger.info("Converting: %d of %d shards written", written, total)
        report("convert", written / total)

    with ThreadPoolExecutor(max_workers=1) as executor:
        # The archive's analysis (numpy and BLAS, which release the GIL) runs on the other core, in this
        # thread's context: its log lines belong to the caller's run (Prefect finds the flow run there).
        analysis = executor.submit(
            contextvars.copy_context().run,
            base_analysis,
            workdir,
            archive.sha256,
            dataset,
            config.near_duplicate_similarity,
        )
        plan = _plan(snapshot, parts, analysis, dataset, config)
        split_arrays, slices = _snapshot_splits(dataset, parts, plan, config.validation_size)
        report("convert", 0.0)
        splits = convert_splits(split_arrays, config, output_dir, on_shard=on_shard)
        report("statistics", 0.0)
        mean, std = channel_statistics(split_arrays["train"][0])
        near_duplicates = _write_near_duplicates(output_dir, analysis.result(), dataset)
    logger.info(
        "Training split mean %s, std %s", [round(value, 4) for value in mean], [round(value, 4) for value in std]
    )
    write_statistics(output_dir, mean, std, splits["train"].num_examples)
    write_class_histogram(output_dir, splits, dataset.class_names)
    atomic_write_json(output_dir / PLAN_FILE, plan.model_dump(mode="json"))
    manifest = Manifest(
        key=key,
        source=SourceInfo(location=config.source, sha256=archive.sha256, md5=archive.md5, layout=dataset.layout),
        class_names=dataset.class_names,
        settings=data_settings(config),
        splits=splits,
        mean=mean,
        std=std,
        snapshot=SnapshotInfo(key=snapshot.key, base_sha256=snapshot.base_sha256, additions=snapshot.additions),
        slices=slices,
        near_duplicates_file=NEAR_DUPLICATES_FILE,
        near_duplicate_test_images=len(near_duplicates.queries()),
        plan_file=PLAN_FILE,
    )
    write_manifest(output_dir, manifest)
    # The temp directory and the manifest are created private (0700 / 0600); the data is readable by
    # the other processes (training, serving) like any other output file.
    os.chmod(output_dir, 0o755)
    for path in output_dir.iterdir():
        os.chmod(path, 0o644)
    report("statistics", 1.0)
    return manifest


def _plan(
    snapshot: SnapshotRecord,
    parts: list[StoredPart],
    analysis: Future[BaseAnalysis],
    dataset: RawDataset,
    config: DataConfig,
) -> SnapshotPlan:
    """Where the added images go; it depends on the archive's test images, so it waits for their analysis."""
    if not parts:
        return SnapshotPlan(snapshot=snapshot.key, validation_fraction=0.0)
    return plan_snapshot(
        snapshot.key,
        parts,
        analysis.result(),
        dataset.test_images,
        validation_fraction=validation_share(config.validation_size, len(dataset.train_images)),
        threshold=config.near_duplicate_similarity,
    )


def _snapshot_splits(
    dataset: RawDataset, parts: list[StoredPart], plan: SnapshotPlan, validation_size: int
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, SliceInfo]]:
    """(images, labels) per split: the archive's splits, each followed by the additions' images in plan order."""
    base = split_dataset(dataset, validation_size)
    by_digest = {part.digest: part for part in parts}
    arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split in ("train", "validation"):
        images, labels = [base[split][0]], [base[split][1]]
        for part_plan in plan.parts:
            part, indices = by_digest[part_plan.digest], np.asarray(getattr(part_plan, split), np.int64)
            images.append(part.images[indices])
            labels.append(part.labels[indices])
        arrays[split] = (np.concatenate(images), np.concatenate(labels))
    arrays["test"] = base["test"]
    validation_start = len(base["validation"][1])
    slices = {}
    if len(arrays["validation"][1]) > validation_start:
        stop = len(arrays["validation"][1])
        slices[NEW_DATA_SLICE] = SliceInfo(split="validation", start=validation_start, stop=stop)
    return arrays, slices


SHEET_PAIRS = 18  # Pairs per group of the contact sheet.


def _write_near_duplicates(output_dir: Path, analysis: BaseAnalysis, dataset: RawDataset) -> NearDuplicates:
    """near_duplicates.parquet (every pair at or above the threshold) and the contact sheet of the closest pairs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = analysis.near_duplicates
    table = pa.table(
        {
            "test_index": pa.array(pairs.query, pa.int64()),
            "train_index": pa.array(pairs.pool, pa.int64()),
            "similarity": pa.array(pairs.similarity, pa.float32()),
        }
    )
    pq.write_table(table, output_dir / NEAR_DUPLICATES_FILE)
    # Near misses (just below the threshold) beside the pairs just above it: what a person needs to judge it.
    threshold = pairs.threshold
    near = analysis.pairs  # Down to the threshold minus a margin.
    below = [(q, p, s) for q, p, s in zip(near.query, near.pool, near.similarity) if s < threshold]
    below = sorted(below, key=lambda item: -item[2])
    found = list(zip(pairs.query, pairs.pool, pairs.similarity))
    just_above = sorted(found, key=lambda item: item[2])[:SHEET_PAIRS]

    def images(items):
        return [(dataset.test_images[q], dataset.train_images[p], s) for q, p, s in items]

    groups = [
        (f"The {SHEET_PAIRS} closest pairs (test | training)", images(found[:SHEET_PAIRS])),
        (f"Just above the threshold {threshold:g}: counted as near-duplicates", images(just_above)),
        ("Just below it: not counted", images(below[:SHEET_PAIRS])),
    ]
    title = f"{len(pairs.queries())} of {len(dataset.test_images):,} test images have a near-duplicate in training"
    atomic_write_bytes(output_dir / NEAR_DUPLICATES_SHEET, plots.near_duplicates_png(groups, title))
    return pairs


def _result(data_dir: Path, manifest: Manifest, *, reused: bool) -> DataResult:
    return DataResult(
        key=manifest.key,
        data_dir=str(data_dir),
        manifest_path=str(data_dir / MANIFEST_NAME),
        source_sha256=manifest.source.sha256,
        reused=reused,
        counts={split: manifest.splits[split].num_examples for split in SPLITS},
        snapshot=manifest.snapshot.key if manifest.snapshot else None,
        additions=manifest.snapshot.additions if manifest.snapshot else [],
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
