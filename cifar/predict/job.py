"""A prediction job: what is scored with which version, its key, where its outputs go, and its reference.

One rule for reuse: a job's key is the input's digest and the model version (an alias resolved first);
a job whose output directory exists is done (docs/BATCH_INFERENCE.md, "Outputs").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cifar.config import MonitorConfig
from cifar.monitoring import MonitoringReference
from cifar.predict.model import ModelVersion
from cifar.predict.sources import ImageSource

PREDICTIONS_DIR = "predictions"  # WORKDIR/predictions/<key>/
PREDICTIONS_FILE = "predictions.parquet"
SUMMARY_FILE = "summary.json"
DRIFT_PNG = "drift.png"


def predictions_root(workdir: str | Path) -> Path:
    return Path(workdir) / PREDICTIONS_DIR


def output_key(digest: str, version: ModelVersion) -> str:
    """The one key of a job's outputs: the input's digest and the model version."""
    return f"{digest[:16]}-{version.name}-v{version.version}"


@dataclass(frozen=True)
class Job:
    """One prediction job: what is scored with which version, where it goes, and what it is judged against."""

    source: ImageSource
    digest: str
    version: ModelVersion
    workdir: Path
    tracking_uri: str
    settings: MonitorConfig
    reference: MonitoringReference | None
    chunk_size: int

    @property
    def key(self) -> str:
        return output_key(self.digest, self.version)

    @property
    def output(self) -> Path:
        return predictions_root(self.workdir) / self.key
