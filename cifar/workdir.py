"""Where every stage puts its files under the workdir. One place, so stages and tasks agree.

The layout: docs/ARCHITECTURE.md ("Workdir layout"). Export versions are consecutive integers under
export/<model_name>/ (TF Serving's layout), published by rename and never overwritten.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from cifar.results import ExportResult

EXPORT_METADATA_PATH = Path("assets.extra") / "export.json"  # Inside a version: TF Serving ignores assets.extra.
# A few test images and the probabilities the verified export gave them: whoever loads the version later (the
# endpoint, cifar.endpoint) checks it answers the same before serving it. numpy's npz, read without pickle.
EXPORT_PROBE_PATH = Path("assets.extra") / "probe.npz"
PROBE_EXAMPLES = 32
EXPORT_PARTIAL_PREFIX = ".export-"  # Hidden temp dirs of exports in flight: not versions, never served.
EXPORT_PARTIAL_SUFFIX = ".partial"
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
    """Renames a finished temp dir, made world-readable, to the next free version number; never replaces one."""
    make_world_readable(temp_dir)
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


def remove_partials(root: Path) -> list[Path]:
    """Deletes the temp directories of exports that died (call it holding the export root's lock)."""
    removed = sorted(root.glob(f"{EXPORT_PARTIAL_PREFIX}*{EXPORT_PARTIAL_SUFFIX}"))
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def make_world_readable(directory: Path) -> None:
    """Directories 0755 and files 0644, as a model server running as another user needs them."""
    for parent, _, files in os.walk(directory):
        os.chmod(parent, 0o755)
        for name in files:
            os.chmod(os.path.join(parent, name), 0o644)
