"""The run directory contract between training (writer) and evaluation/export (readers).

Layout below (file names) and in docs/ARCHITECTURE.md ("Run directory and checkpoint contract").
index.json is each epoch's commit point: an epoch counts once the index lists it, so a reader never
sees an entry whose files are missing; a run is reusable once state.json says `completed` under its key.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from cifar.io import atomic_write_json, file_digest, read_json
from cifar.results import TrainResult

# RUN_DIR/state.json, history.json, training_curves.png and checkpoints/ (epoch files, index.json).
INDEX_NAME = "index.json"  # Every kept checkpoint with its validation metrics, and the best one.
STATE_NAME = "state.json"  # The stage key, the MLflow run id, the status and, once complete, the result.
HISTORY_NAME = "history.json"  # One value per completed epoch and metric.
PLOT_NAME = "training_curves.png"
TEMP_PREFIX = ".tmp-"  # Files written under this prefix, then renamed into place.


class CheckpointEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epoch: int  # 1-based: the number of completed epochs.
    model_path: str  # Relative to the checkpoint dir.
    eval_weights_path: str  # Relative to the checkpoint dir.
    metrics: dict[str, float]  # At least val_accuracy and val_loss when a validation split exists.


class PartialEpoch(BaseModel):
    """The state saved mid-epoch when training was stopped (SIGTERM, `cifar.preemption`): a resume continues
    epoch `epoch` from step `step + 1`. Cleared by the next epoch's commit."""

    model_config = ConfigDict(extra="forbid")
    epoch: int  # 1-based: the epoch in progress (the latest committed one + 1).
    step: int  # Steps of that epoch done (1 <= step < steps per epoch).
    model_path: str  # Relative to the checkpoint dir: model + optimizer after that step.
    metric_values: list[list[float]]  # The epoch's running training metrics (`model.metrics_variables`), flattened.
    seconds: float  # Wall time spent in the epoch so far, added to its `epoch_seconds`.


class CheckpointIndex(BaseModel):
    model_config = ConfigDict(extra="forbid")
    entries: list[CheckpointEntry] = []
    best_epoch: int | None = None  # The epoch with the highest val_accuracy (last epoch without validation).
    partial: PartialEpoch | None = None  # A stop mid-epoch; readers of finished epochs ignore it.

    def entry(self, epoch: int) -> CheckpointEntry:
        for entry in self.entries:
            if entry.epoch == epoch:
                return entry
        raise KeyError(f"no checkpoint for epoch {epoch}")

    @property
    def latest(self) -> CheckpointEntry | None:
        return max(self.entries, key=lambda entry: entry.epoch, default=None)

    @property
    def best(self) -> CheckpointEntry | None:
        return None if self.best_epoch is None else self.entry(self.best_epoch)


def checkpoint_file_names(epoch: int) -> tuple[str, str]:
    """The model file and evaluation-weights file names of an epoch.

    epoch-0007.keras is the full model and optimizer state after epoch 7 (what resume loads);
    epoch-0007.eval.weights.h5 the weights to evaluate: the EMA weights when EMA is on, else the same.
    """
    return f"epoch-{epoch:04d}.keras", f"epoch-{epoch:04d}.eval.weights.h5"


def partial_checkpoint_name(epoch: int, step: int) -> str:
    """epoch-0007-step-000045.keras: model and optimizer after step 45 of epoch 7 (a stop mid-epoch)."""
    return f"epoch-{epoch:04d}-step-{step:06d}.keras"


def load_index(checkpoint_dir: str | Path) -> CheckpointIndex:
    """The index, or an empty one when no checkpoint was written yet."""
    path = Path(checkpoint_dir) / INDEX_NAME
    if not path.is_file():
        return CheckpointIndex()
    return CheckpointIndex.model_validate(read_json(path))


def write_index(checkpoint_dir: str | Path, index: CheckpointIndex) -> Path:
    return atomic_write_json(Path(checkpoint_dir) / INDEX_NAME, index.model_dump())


def index_digest(checkpoint_dir: str | Path) -> str:
    """The SHA-256 of the index: which checkpoints exist and what they scored (what evaluation reads).

    "none" when there is no index yet (evaluating then fails with a clear error).
    """
    path = Path(checkpoint_dir) / INDEX_NAME
    return file_digest(path) if path.is_file() else "none"


def updated_index(index: CheckpointIndex, entry: CheckpointEntry, keep: int) -> CheckpointIndex:
    """The index with `entry` added (replacing a same-epoch entry), trimmed to the last `keep` + best.

    Best is the highest `val_accuracy` (the earliest on ties); without validation, the latest. A partial
    epoch's state is dropped: the committed epoch supersedes it.
    """
    entries = [old for old in index.entries if old.epoch < entry.epoch] + [entry]
    if "val_accuracy" in entry.metrics:
        best = max(entries, key=lambda item: (item.metrics.get("val_accuracy", -math.inf), -item.epoch))
    else:
        best = entry
    recent = sorted(entries, key=lambda item: item.epoch)[-keep:]
    kept = sorted({item.epoch: item for item in [*recent, best]}.values(), key=lambda item: item.epoch)
    return CheckpointIndex(entries=kept, best_epoch=best.epoch)


def save_file(path: Path, save: Callable[[Path], None]) -> None:
    """Lets `save` write a temp file beside `path` (same suffix, which Keras dispatches on), then renames it."""
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}")
    save(temp)
    with open(temp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temp, path)


def remove_unlisted(checkpoint_dir: Path, index: CheckpointIndex) -> None:
    """Deletes half-written temp files and checkpoints the index no longer lists."""
    kept = {name for entry in index.entries for name in (entry.model_path, entry.eval_weights_path)}
    if index.partial is not None:
        kept.add(index.partial.model_path)
    for path in [*checkpoint_dir.glob(f"{TEMP_PREFIX}*"), *checkpoint_dir.glob("epoch-*")]:
        if path.name not in kept:
            path.unlink(missing_ok=True)


# The history: one column per metric, one value per completed epoch.


def append_epoch(history: dict[str, list], epoch: int, metrics: dict[str, float]) -> None:
    """Adds one epoch to a column-per-metric history, keeping every column one value per epoch.

    A metric missing from this epoch gets None; a metric new in this epoch gets None for the
    earlier epochs, so position i of every list always belongs to `history["epoch"][i]`.
    """
    previous = len(history.get("epoch", []))
    history.setdefault("epoch", []).append(epoch)
    for key, value in metrics.items():
        history.setdefault(key, [None] * previous).append(value)
    for values in history.values():
        if len(values) < previous + 1:
            values.append(None)


def history_rows(history: dict[str, list]) -> list[tuple[int, dict[str, float]]]:
    """(epoch, metrics) per recorded epoch, leaving out metrics missing in that epoch."""
    rows = []
    for position, epoch in enumerate(history.get("epoch", [])):
        metrics = {
            key: values[position]
            for key, values in history.items()
            if key != "epoch" and position < len(values) and values[position] is not None
        }
        rows.append((int(epoch), metrics))
    return rows


class RunDirectory:
    """One training run's folder: its files, and its bookkeeping in state.json."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.name = self.path.name
        self.checkpoint_dir = self.path / "checkpoints"
        self.state_path = self.path / STATE_NAME
        self.history_path = self.path / HISTORY_NAME
        self.plot_path = self.path / PLOT_NAME

    def read_state(self) -> dict:
        return read_json(self.state_path) if self.state_path.is_file() else {}

    def write_state(
        self, key: str, mlflow_run_id: str | None, tracking_uri: str, status: str, result: TrainResult | None = None
    ) -> None:
        state = {
            "run_name": self.name,
            "key": key,
            "mlflow_run_id": mlflow_run_id,
            "tracking_uri": tracking_uri,
            "status": status,
        }
        if result is not None:
            state["result"] = result.model_dump(exclude={"reused"})
        atomic_write_json(self.state_path, state)

    def completed(self, key: str) -> TrainResult | None:
        """The stored result of a finished run made under `key` whose checkpoints are all in place, else None."""
        state = self.read_state()
        if state.get("status") != "completed" or state.get("key") != key or "result" not in state:
            return None
        index = load_index(self.checkpoint_dir)
        files = [
            self.checkpoint_dir / name
            for entry in index.entries
            for name in (entry.model_path, entry.eval_weights_path)
        ]
        if not files or not all(path.is_file() for path in files):
            return None
        return TrainResult.model_validate({**state["result"], "reused": True})

    def check_key(self, key: str) -> None:
        """Refuses to continue a run made under another key (another config or code in a named folder)."""
        recorded = self.read_state().get("key", key)
        if recorded != key:
            raise ValueError(
                f"{self.path} holds a training run of another configuration or code version "
                f"(key {recorded}, this run's is {key}): choose another train.run_name, or "
                "pass --fresh to discard it"
            )

    def read_history(self, epochs: int) -> dict[str, list]:
        """The recorded history of the first `epochs` epochs (a kill may have left one more)."""
        if not self.history_path.is_file():
            return {}
        history = read_json(self.history_path)
        keep = [position for position, epoch in enumerate(history.get("epoch", [])) if epoch <= epochs]
        if not keep:
            return {}
        return {
            key: [values[position] for position in keep if position < len(values)] for key, values in history.items()
        }

    def discard(self) -> None:
        """Moves the folder aside, then deletes it (a crash midway never leaves a half-deleted run in place)."""
        if not self.path.exists():
            return
        aside = self.path.with_name(f".{self.name}.discarded-{time.time_ns()}")
        self.path.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class TrainingStart:
    """Where training starts: committed epochs, a stop mid-epoch after them, and the file to restore."""

    epoch: int
    partial: PartialEpoch | None
    checkpoint: Path | None

    @classmethod
    def of(cls, run: RunDirectory, index: CheckpointIndex) -> TrainingStart:
        # An epoch counts once index.json lists it: after a kill anywhere no epoch is lost and none counted twice.
        # A stop by SIGTERM saved mid-epoch (`index.partial`): that epoch continues from its next step.
        epoch = index.latest.epoch if index.latest else 0
        restore = index.partial.model_path if index.partial else index.latest.model_path if epoch else None
        return cls(epoch, index.partial, run.checkpoint_dir / restore if restore else None)

    def describe(self) -> str:
        return f"step {self.partial.step} of epoch {self.partial.epoch}" if self.partial else f"epoch {self.epoch}"


def select_for_evaluation(index: CheckpointIndex, which: str) -> list[CheckpointEntry]:
    """`best` -> [the best entry]; `all` -> every kept entry, oldest first."""
    if not index.entries:
        raise FileNotFoundError("no checkpoints to evaluate: train first")
    if which == "best":
        return [index.best or index.latest]
    if which == "all":
        return sorted(index.entries, key=lambda entry: entry.epoch)
    raise ValueError(f"which must be 'best' or 'all', got {which!r}")


def load_eval_model(checkpoint_dir: str | Path, entry: CheckpointEntry):
    """The Keras model of a checkpoint with its evaluation (EMA) weights loaded, compiled-free."""
    import keras

    import cifar.models  # noqa: F401  Registers the custom layers before deserializing.

    checkpoint_dir = Path(checkpoint_dir)
    model = keras.models.load_model(checkpoint_dir / entry.model_path, compile=False)
    model.load_weights(checkpoint_dir / entry.eval_weights_path)
    return model


def saved_kernels(checkpoint: str | Path) -> dict[str, bool]:
    """{"batchnorm": fused?, "gelu": fused?} of the model saved in a .keras checkpoint (a layer it lacks: absent).

    A resumed run must build the kinds it saved: Keras finds saved weights by layer class, so a checkpoint of
    Keras's BatchNormalization does not load into FusedBatchNormalization layers (a ValueError), nor back.
    """
    import json
    import zipfile

    with zipfile.ZipFile(checkpoint) as archive:
        config = json.loads(archive.read("config.json"))
    layers = config.get("config", {}).get("layers", [])
    classes = {layer.get("class_name") for layer in layers}
    activations = {
        layer.get("config", {}).get("activation") for layer in layers if layer.get("class_name") == "Activation"
    }
    kinds = {}
    if "FusedBatchNormalization" in classes or "BatchNormalization" in classes:
        kinds["batchnorm"] = "FusedBatchNormalization" in classes
    if "Gelu" in classes or "gelu" in activations:
        kinds["gelu"] = "Gelu" in classes
    return kinds
