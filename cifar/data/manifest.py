"""The manifest: what the data stage produced, and the contract every later stage reads.

One `tf.train.Example` per image: `image` (3,072 raw uint8 bytes, HWC) and `label` (int64 0..9), in
uncompressed TFRecord shards; paths are relative to the manifest's folder (docs/ARCHITECTURE.md, "Data contract").
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from cifar.io import atomic_write_json, read_json

FORMAT_VERSION = 2  # 2: snapshots (additions, the new_data slice, near-duplicates of test images).
MANIFEST_NAME = "manifest.json"
IMAGE_SHAPE = (32, 32, 3)
IMAGE_BYTES = 32 * 32 * 3  # One raw image: the `image` feature, a row of the python layout.
NUM_CLASSES = 10
STATISTICS_FILE = "statistics.parquet"
CLASS_HISTOGRAM_FILE = "class_histogram.parquet"
NEAR_DUPLICATES_FILE = "near_duplicates.parquet"  # test_index, train_index, similarity, near_duplicate.
NEAR_DUPLICATES_SHEET = "near_duplicates.png"  # The closest pairs and those around the threshold.
PLAN_FILE = "plan.json"  # cifar.data.plan.SnapshotPlan.
NEW_DATA_SLICE = "new_data"


class Shard(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str  # Relative to the data directory.
    sha256: str
    num_examples: int
    num_bytes: int | None = None  # File size: a cheap completeness check before trusting a data dir.


class Split(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_examples: int
    class_counts: list[int]  # Index = class id.
    shards: list[Shard]


class SourceInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    location: str  # What the user passed as the source.
    sha256: str
    md5: str
    layout: str  # "python" or "binary".


class SliceInfo(BaseModel):
    """Examples [start, stop) of a split, in shard order."""

    model_config = ConfigDict(extra="forbid")
    split: str
    start: int
    stop: int


class SnapshotInfo(BaseModel):
    """The snapshot a data directory holds: its key, base archive and additions."""

    model_config = ConfigDict(extra="forbid")
    key: str
    base_sha256: str
    additions: list[str] = []  # Digests, in the canonical (sorted) order their images follow the archive's.


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format_version: int = FORMAT_VERSION
    key: str | None = None  # The data stage's key (cifar.reuse.data_key), also the directory's suffix.
    source: SourceInfo
    class_names: list[str]
    image_shape: list[int] = list(IMAGE_SHAPE)
    settings: dict  # The data settings that shaped the shards (validation size, shard counts).
    splits: dict[str, Split]  # "train", "validation" (may hold 0 examples), "test".
    mean: list[float]  # Per channel, 0..1 scale, training split.
    std: list[float]
    statistics_file: str = STATISTICS_FILE
    class_histogram_file: str = CLASS_HISTOGRAM_FILE
    snapshot: SnapshotInfo | None = None  # The archive plus its additions (cifar.data.snapshots).
    slices: dict[str, SliceInfo] = {}  # Named ranges of a split; `new_data`: the additions' validation images.
    near_duplicates_file: str | None = None  # The test images with a near-duplicate in the archive's training batches.
    near_duplicate_test_images: int | None = None  # Test images with a near-duplicate in the training batches.
    plan_file: str | None = None  # Where every added image went and why (cifar.data.plan).

    def shard_paths(self, data_dir: str | Path, split: str) -> list[str]:
        """Absolute shard paths of a split."""
        return [str(Path(data_dir) / shard.path) for shard in self.splits[split].shards]


def load_manifest(data_dir: str | Path) -> Manifest:
    """Reads and validates `data_dir/manifest.json`."""
    path = Path(data_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no manifest at {path}: run the data stage first")
    manifest = Manifest.model_validate(read_json(path))
    if manifest.format_version != FORMAT_VERSION:
        raise ValueError(f"{path} has format version {manifest.format_version}, expected {FORMAT_VERSION}")
    return manifest


def write_manifest(data_dir: str | Path, manifest: Manifest) -> Path:
    """Atomically writes the manifest (stable bytes for the same content)."""
    return atomic_write_json(Path(data_dir) / MANIFEST_NAME, manifest.model_dump())
