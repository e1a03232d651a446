"""The training-curve figure: loss, accuracy and learning rate per epoch."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # Files only: training runs on headless machines.

import matplotlib.pyplot as plt  # noqa: E402

PANELS = {"loss": ["loss", "val_loss"], "accuracy": ["accuracy", "val_accuracy"], "learning rate": ["learning_rate"]}


def plot_training_curves(history: dict[str, list[float]], path: str | Path) -> Path:
    """Writes a PNG with loss, accuracy (training and validation) and the learning rate per epoch.

    `history` maps metric names to one value per epoch; an `epoch` list gives the x axis
    (1, 2, ... when missing). Metrics that are absent are left out of their panel.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = [len(values) for key, values in history.items() if key != "epoch"]
    epochs = history.get("epoch") or list(range(1, max(lengths, default=0) + 1))
    figure, axes = plt.subplots(1, len(PANELS), figsize=(4.5 * len(PANELS), 3.5))
    for axis, (title, keys) in zip(axes, PANELS.items()):
        for key in keys:
            values = history.get(key)
            if values:
                axis.plot(epochs[: len(values)], values, marker="o", markersize=3, label=key)
        axis.set_title(title)
        axis.set_xlabel("epoch")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend()
    figure.tight_layout()
    temp = path.with_name(f".{path.stem}.tmp.png")
    figure.savefig(temp, dpi=100)
    plt.close(figure)
    temp.replace(path)
    return path
