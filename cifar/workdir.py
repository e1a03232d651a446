"""Where every stage puts its files under the workdir. One place, so stages and tasks agree.

WORKDIR/
  downloads/                       archives fetched from http(s) sources (.part while in flight)
  data/cifar10-<key>/              TFRecord shards, manifest.json, statistics parquet (data stage)
  runs/<run_name>/                 one training run: checkpoints/, history, plots, state.json
  runs/<run_name>/evaluation/      metrics.json, predictions.parquet, plots (evaluate stage)
  export/<model_name>/<version>/   TF-Serving SavedModel versions (export stage); assets.extra/export.json
                                   holds the version's key and result
  mlflow.db, mlartifacts/          the embedded MLflow store (unless MLFLOW_TRACKING_URI is set)
  summary.json                     what the last pipeline run produced
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from cifar.results import ExportResult

EXPORT_METADATA_PATH = Path("assets.extra") / "export.json"  # Inside a version: TF Serving ignores assets.extra.
EXPORT_PARTIAL_PREFIX = ".export-"  # Hidden temp dirs of exports in flight: not versions, never served.
EXPORT_PARTIAL_SUFFIX = ".partial"
STALE_PARTIAL_SECONDS = 3600  # Temp dirs older than this belong to an export that died; younger may be running.
PUBLISH_ATTEMPTS = 100  # Version numbers tried when concurrent exports race for the next one.


def stable_hash(value: Any, length: int = 12) -> str:
    """Short SHA-256 of a JSON-serialisable value with sorted keys (same value -> same hash)."""
    text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:length]


def downloads_dir(workdir: Path) -> Path:
    return Path(workdir) / "downloads"


def data_root(workdir: Path) -> Path:
    return Path(workdir) / "data"


def runs_root(workdir: Path) -> Path:
    return Path(workdir) / "runs"


def run_dir(workdir: Path, run_name: str) -> Path:
    return runs_root(workdir) / run_name


def export_root(workdir: Path, model_name: str) -> Path:
    return Path(workdir) / "export" / model_name


def summary_path(workdir: Path) -> Path:
    return Path(workdir) / "summary.json"


# Export versions (TF Serving's layout: integer directories under export/<model_name>/).


def existing_versions(root: Path) -> list[int]:
    """The published version numbers under an export root, ascending (temp dirs are not versions)."""
    if not root.is_dir():
        return []
    return sorted(int(path.name) for path in root.iterdir() if path.is_dir() and path.name.isdigit())


def find_export(root: Path, key: str) -> ExportResult | None:
    """The ExportResult of the version published under `key`, or None."""
    for version in reversed(existing_versions(root)):
        metadata_path = root / str(version) / EXPORT_METADATA_PATH
        with contextlib.suppress(OSError, ValueError):
            metadata = json.loads(metadata_path.read_text(encoding="utf-8"))
            if metadata.get("key") == key:
                return ExportResult.model_validate(
                    {**metadata["result"], "export_dir": str(root / str(version)), "version": version, "reused": True}
                )
    return None


def publish_version(temp_dir: Path, root: Path) -> tuple[int, Path]:
    """Renames a finished temp dir to the next free version number; never replaces an existing version."""
    for _ in range(PUBLISH_ATTEMPTS):
        version = max(existing_versions(root), default=0) + 1
        final = root / str(version)
        try:
            # rename(2) refuses a non-empty target, so a version another export just published survives.
            os.rename(temp_dir, final)
            return version, final
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    raise RuntimeError(f"could not claim a version number under {root}")


def remove_stale_partials(root: Path, max_age_seconds: float = STALE_PARTIAL_SECONDS) -> list[Path]:
    """Deletes temp dirs that interrupted exports left behind; returns what was removed."""
    removed = []
    now = time.time()
    for path in root.glob(f"{EXPORT_PARTIAL_PREFIX}*{EXPORT_PARTIAL_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            if now - path.stat().st_mtime >= max_age_seconds:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed
