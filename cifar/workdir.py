"""Where every stage puts its files under the workdir. One place, so stages and tasks agree.

    WORKDIR/
      downloads/                       archives fetched from http(s) sources (.part while in flight)
      data/cifar10-<key>/              TFRecord shards, manifest.json, statistics parquet (data stage)
      runs/<run_name>/                 one training run: checkpoints/, history, plots, state.json
      runs/<run_name>/evaluation/      metrics.json, predictions.parquet, plots (evaluate stage)
      export/<model_name>/<version>/   TF-Serving SavedModel versions (export stage)
      mlflow.db, mlartifacts/          the embedded MLflow store (unless MLFLOW_TRACKING_URI is set)
      summary.json                     what the last pipeline run produced
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


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
