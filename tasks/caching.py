"""Prefect's cache as a thin layer over the library's reuse rule (`cifar.reuse`).

A task's cache key is its stage's key, computed by the library from the task's inputs; a cached
result is returned only while the library would still reuse it, otherwise the record is expired and
the task runs (and the library decides). The cache saves starting a stage (and importing TensorFlow)
and shows the task as Cached. Records are JSON under `WORKDIR/prefect-results/`.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import CachePolicy

logger = logging.getLogger("tasks.caching")

RESULTS_DIR_NAME = "prefect-results"


def result_storage(workdir: str | Path) -> Path:
    """Where task results persist: `WORKDIR/prefect-results/`, shared by every process on this machine.

    A path (Prefect wraps it in a local file system) needs no storage block saved on the server.
    """
    path = Path(workdir).expanduser().resolve() / RESULTS_DIR_NAME
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class StageCachePolicy(CachePolicy):
    """Caches a stage under `key_fn(**inputs)` and returns a cached result only if `is_valid` accepts it.

    `key_fn` gets the task's inputs by name and returns the library's key; `is_valid` gets the cached
    result and asks the library whether it still holds. A result that fails is expired before the
    engine looks the key up, so the task runs and its new result replaces the old one.
    """

    key_fn: Callable[..., str] | None = None
    is_valid: Callable[[Any], bool] = field(default=lambda result: True)

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str:
        if self.key_fn is None:
            raise ValueError("StageCachePolicy needs a key_fn")
        key = f"{task_ctx.task.name}-{self.key_fn(**inputs)}"
        store = getattr(task_ctx, "result_store", None)
        if store is not None and not task_ctx.task.refresh_cache:
            expire_if_invalid(store, key, self.is_valid)
        return key


def stage_task(name: str, *, key_fn: Callable[..., str], is_valid: Callable[[Any], bool], **options: Any):
    """Prefect's `task` decorator for a pipeline stage: cached by `StageCachePolicy`, results persisted as JSON."""
    return task(
        name=name,
        cache_policy=StageCachePolicy(key_fn=key_fn, is_valid=is_valid),
        persist_result=True,
        result_serializer="json",
        **options,
    )


def expire_if_invalid(store, key: str, is_valid: Callable[[Any], bool]) -> bool:
    """Expires the record under `key` when the library would no longer reuse its result; True when it did."""
    if not store.exists(key):
        return False
    try:
        result = store.read(key).result
        valid = bool(is_valid(result))
    except Exception as error:  # An unreadable record (e.g. a result class that changed) is stale too.
        logger.warning("Cached result %s is unreadable (%s): recomputing", key, error)
        result, valid = None, False
    if valid:
        return False
    logger.warning("Cached result %s no longer matches its files: recomputing", key)
    expired = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1)
    store.write(obj=result, key=key, expiration=expired)
    return True
