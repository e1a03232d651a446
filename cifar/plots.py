"""Evaluation plots: the confusion matrix and a grid of misclassified test images, as PNG bytes.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no global backend state), so
plotting works in worker threads and on machines without a display. Callers write the bytes
atomically where they belong.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def figure_png(figure: Figure, dpi: int = 100) -> bytes:
    """Renders a figure to PNG bytes."""
    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def confusion_matrix_png(matrix: np.ndarray, class_names: Sequence[str], title: str = "Confusion matrix") -> bytes:
    """A heat map of counts (rows = true class, columns = predicted class) with the count in each cell."""
    matrix = np.asarray(matrix)
    num_classes = len(class_names)
    if matrix.shape != (num_classes, num_classes):
        raise ValueError(f"matrix must be {num_classes}x{num_classes}, got shape {matrix.shape}")
    figure = Figure(figsize=(7.5, 6.5))
    axes = figure.add_subplot()
    image = axes.imshow(matrix, cmap="Blues")
    figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04)
    axes.set_xticks(range(num_classes), labels=class_names, rotation=45, ha="right")
    axes.set_yticks(range(num_classes), labels=class_names)
    axes.set(xlabel="predicted class", ylabel="true class", title=title)
    # White text on dark cells keeps every count readable.
    threshold = matrix.max() / 2 if matrix.size and matrix.max() > 0 else 0
    for (row, column), count in np.ndenumerate(matrix.astype(np.int64)):
        color = "white" if count > threshold else "black"
        axes.text(column, row, str(count), ha="center", va="center", fontsize=7, color=color)
    return figure_png(figure)


def misclassified_grid_png(
    images: np.ndarray,
    labels: Sequence[int],
    predictions: Sequence[int],
    class_names: Sequence[str],
    title: str = "Misclassified test images (true / predicted)",
) -> bytes:
    """A square-ish grid of images (N, H, W, 3) uint8, each titled `true / predicted`."""
    images = np.asarray(images)
    count = len(images)
    if count != len(labels) or count != len(predictions):
        raise ValueError(f"got {count} images, {len(labels)} labels and {len(predictions)} predictions")
    columns = max(1, math.ceil(math.sqrt(count)))
    rows = max(1, math.ceil(count / columns))
    figure = Figure(figsize=(1.6 * columns, 1.8 * rows + 0.4))
    figure.suptitle(title)
    if count == 0:
        axes = figure.add_subplot()
        axes.text(0.5, 0.5, "no misclassified images", ha="center", va="center")
        axes.axis("off")
        return figure_png(figure)
    for position, (image, label, prediction) in enumerate(zip(images, labels, predictions)):
        axes = figure.add_subplot(rows, columns, position + 1)
        axes.imshow(image, interpolation="nearest")
        axes.set_title(f"{class_names[int(label)]}\n/ {class_names[int(prediction)]}", fontsize=7)
        axes.axis("off")
    return figure_png(figure)
