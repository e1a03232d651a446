"""Cache keys from content, and cached results that are checked before they are trusted.

A stage's cache key hashes three things and nothing else:
  - the content it reads: the archive's SHA-256, the upstream stage's output fingerprint;
  - the config fields that change its output (`STAGE_FIELDS`), never the ones that cannot;
  - the code version of the stage: a hash of the `cifar/` source files it runs (`STAGE_SOURCES`).

Results are persisted as JSON under `WORKDIR/prefect-results/`, so a new process (or a worker on the
same machine) reuses them. Every result names files, and a cached result is only returned while those
files are still what the stage wrote: each result carries a `fingerprint` of its outputs (relative
paths, sizes and modification times), and `StageCachePolicy` re-checks it when the key is looked up.
A result whose files were deleted or altered is expired on the spot, so the task runs again.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from prefect import task
from prefect.cache_policies import CachePolicy

from cifar.config import PipelineConfig
from cifar.tracking import resolve_tracking_uri
from cifar.workdir import stable_hash

logger = logging.getLogger("tasks.caching")

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "cifar"
RESULTS_DIR_NAME = "prefect-results"
KEY_LENGTH = 32  # Hex characters of a cache key's hash.

# The cifar/ source files (globs relative to cifar/) whose code each stage runs. Editing one of them
# changes that stage's code version, hence its cache key, hence the stages downstream of it.
STAGE_SOURCES: dict[str, tuple[str, ...]] = {
    "download": ("data/download.py", "io.py"),
    "data": ("data/*.py", "io.py", "workdir.py"),
    "train": ("train.py", "callbacks.py", "checkpoints.py", "distribute.py", "input_pipeline.py", "layers.py",
              "models.py", "performance.py", "schedules.py", "tracking.py", "train_plots.py", "io.py",
              "workdir.py", "data/manifest.py"),
    "evaluate": ("evaluate.py", "checkpoints.py", "layers.py", "models.py", "plots.py", "tracking.py", "io.py",
                 "data/manifest.py"),
    "export": ("export.py", "results.py", "evaluate.py", "checkpoints.py", "layers.py", "models.py", "tracking.py",
               "io.py", "data/manifest.py"),
    "register": ("registry.py", "export.py", "results.py", "tracking.py"),
}

# The config fields that shape each stage's output. Anything else (retries, where the archive came
# from once its digest is known, `train.resume`, later stages' settings) leaves the key alone.
STAGE_FIELDS: dict[str, dict[str, set[str] | None]] = {
    # None = the whole section; a set = only those fields.
    "download": {"data": {"source", "sha256", "md5"}},
    "data": {"data": {"validation_size", "train_shards", "validation_shards", "test_shards",
                      "expect_official_counts"}},
    "train": {"train": None, "seed": None, "tracking": {"experiment"}},
    "evaluate": {"evaluate": None},
    "export": {"export": {"model_name"}, "evaluate": {"batch_size"}},
    "register": {"export": None},
}
TRAIN_FIELDS_IGNORED = {"resume"}  # Resuming or not changes how long training takes, not its inputs.


def code_version(stage: str) -> str:
    """A hash of the source files of `stage` (their names and bytes); files that do not exist are skipped."""
    files: dict[str, str] = {}
    for pattern in STAGE_SOURCES[stage]:
        for path in sorted(PACKAGE_DIR.glob(pattern)):
            if path.is_file():
                files[path.relative_to(PACKAGE_DIR).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return stable_hash(files, 16)


def config_fields(stage: str, config: PipelineConfig) -> dict[str, Any]:
    """The part of the config that stage `stage` depends on, as plain JSON values."""
    selected: dict[str, Any] = {}
    dumped = config.model_dump(mode="json")
    for section, fields in STAGE_FIELDS[stage].items():
        value = dumped[section]
        if isinstance(value, dict):
            value = {name: item for name, item in value.items() if fields is None or name in fields}
            if section == "train":
                value = {name: item for name, item in value.items() if name not in TRAIN_FIELDS_IGNORED}
        selected[section] = value
    return selected


def stage_key(stage: str, config: PipelineConfig, upstream: dict[str, Any] | None = None) -> str:
    """The cache key of `stage`: its config fields, its upstream content and its code version."""
    material = {"config": config_fields(stage, config), "upstream": upstream or {}, "code": code_version(stage)}
    return f"{stage}-{stable_hash(material, KEY_LENGTH)}"


def fingerprint(paths: Iterable[str | Path], root: str | Path | None = None) -> str:
    """A cheap fingerprint of files and directories: relative path, size and mtime of every file.

    A missing path fingerprints as missing, so deleting any output changes the fingerprint, and so
    does rewriting a file (new mtime) or truncating it (new size). Nothing is read, so it is fast
    even for the full dataset.
    """
    entries: list[tuple[str, int, int] | tuple[str, str]] = []
    for path in map(Path, paths):
        base = Path(root) if root is not None else path.parent
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(item for item in path.rglob("*") if item.is_file())
            if not files:
                entries.append((_relative(path, base), "empty"))
        else:
            entries.append((_relative(path, base), "missing"))
            continue
        for item in files:
            stat = item.stat()
            entries.append((_relative(item, base), stat.st_size, stat.st_mtime_ns))
    return stable_hash(entries, 32)


def _relative(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.as_posix()


def tracking_uri(config: PipelineConfig, workdir: str | Path) -> str:
    """Where this config's MLflow runs live (part of the training key: a run id is only valid there)."""
    return resolve_tracking_uri(config.tracking, workdir)


def result_storage(workdir: str | Path) -> Path:
    """Where task results persist: `WORKDIR/prefect-results/`, shared by every process on this machine.

    A path (Prefect wraps it in a local file system) needs no storage block saved on the server.
    """
    path = Path(workdir).expanduser().resolve() / RESULTS_DIR_NAME
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class StageCachePolicy(CachePolicy):
    """Caches a stage by `key_fn(**inputs)` and only returns a cached result that `is_valid` accepts.

    `key_fn` gets the task's inputs by name and returns the key; `is_valid` gets the cached result
    and says whether its files are still the ones the stage wrote (see `fingerprint`). A cached
    result that fails the check is expired before the engine looks the key up, so the task runs and
    its new result replaces the stale one under the same key.
    """

    key_fn: Callable[..., str] | None = None
    is_valid: Callable[[Any], bool] = field(default=lambda result: True)

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str:
        if self.key_fn is None:
            raise ValueError("StageCachePolicy needs a key_fn")
        key = self.key_fn(**inputs)
        store = getattr(task_ctx, "result_store", None)
        if store is not None and not task_ctx.task.refresh_cache:
            expire_if_invalid(store, key, self.is_valid)
        return key


def stage_task(name: str, *, key_fn: Callable[..., str], is_valid: Callable[[Any], bool], **options: Any):
    """Prefect's `task` decorator for a pipeline stage: cached by `StageCachePolicy`, results persisted as JSON."""
    return task(name=name, cache_policy=StageCachePolicy(key_fn=key_fn, is_valid=is_valid), persist_result=True,
                result_serializer="json", **options)


def expire_if_invalid(store, key: str, is_valid: Callable[[Any], bool]) -> bool:
    """Expires the record under `key` when its result's files changed; True when it did."""
    if not store.exists(key):
        return False
    try:
        result = store.read(key).result
        valid = bool(is_valid(result))
    except Exception as error:  # An unreadable record (e.g. a model class that changed) is stale too.
        logger.warning("Cached result %s is unreadable (%s): recomputing", key, error)
        result, valid = None, False
    if valid:
        return False
    logger.warning("Cached result %s points at files that were deleted or changed: recomputing", key)
    expired = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1)
    store.write(obj=result, key=key, expiration=expired)
    return True

