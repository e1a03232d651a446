"""The checkpoint directory contract between training (writer) and evaluation/export (readers).

    CHECKPOINT_DIR/
      epoch-0007.keras             full model + optimizer state after epoch 7 (what resume loads)
      epoch-0007.eval.weights.h5   the weights to evaluate: the EMA weights when EMA is on, else the same
      index.json                   every kept checkpoint with its validation metrics, and the best one

Training keeps the last K epochs plus the best by validation accuracy (never chosen on test).
The index is rewritten atomically after each epoch's files are in place, so a reader never sees
an entry whose files are missing.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from cifar.io import atomic_write_json, read_json

INDEX_NAME = "index.json"


class CheckpointEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epoch: int  # 1-based: the number of completed epochs.
    model_path: str  # Relative to the checkpoint dir.
    eval_weights_path: str  # Relative to the checkpoint dir.
    metrics: dict[str, float]  # At least val_accuracy and val_loss when a validation split exists.


class CheckpointIndex(BaseModel):
    model_config = ConfigDict(extra="forbid")
    entries: list[CheckpointEntry] = []
    best_epoch: int | None = None  # The epoch with the highest val_accuracy (last epoch without validation).

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
    """The model file and evaluation-weights file names of an epoch."""
    return f"epoch-{epoch:04d}.keras", f"epoch-{epoch:04d}.eval.weights.h5"


def load_index(checkpoint_dir: str | Path) -> CheckpointIndex:
    """The index, or an empty one when no checkpoint was written yet."""
    path = Path(checkpoint_dir) / INDEX_NAME
    if not path.is_file():
        return CheckpointIndex()
    return CheckpointIndex.model_validate(read_json(path))


def write_index(checkpoint_dir: str | Path, index: CheckpointIndex) -> Path:
    return atomic_write_json(Path(checkpoint_dir) / INDEX_NAME, index.model_dump())


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
