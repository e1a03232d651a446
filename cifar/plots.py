"""Every figure the project draws: training curves, evaluation plots, near-duplicate sheets, drift histograms.

Drawn on matplotlib's Agg canvas directly (no pyplot, no global backend state), so plotting works in
worker threads and on machines without a display; most return PNG bytes the caller writes atomically.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(**figure_options) -> Figure:
    """A matplotlib Figure on an Agg canvas of its own.

    matplotlib is imported here, at the first figure, not with this module: the flows import this module
    through their tasks, and the processes that never draw (a command line's dry run or decision, a resumed
    run whose stages are all reused, `prefect deploy` loading the flows) import none of it. With scipy.spatial
    left to cifar.data.drift's comparison likewise: the flows import in 2.58 CPU-s instead of 3.14
    (bench/startup.py)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(**figure_options)
    FigureCanvasAgg(figure)
    return figure


def figure_png(figure: Figure, dpi: int = 100) -> bytes:
    """Renders a figure made by `new_figure` (its Agg canvas attached) to PNG bytes."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


TRAINING_PANELS = {
    "loss": ["loss", "val_loss"],
    "accuracy": ["accuracy", "val_accuracy"],
    "learning rate": ["learning_rate"],
}


def plot_training_curves(history: dict[str, list[float]], path: str | Path) -> Path:
    """Writes a PNG with loss, accuracy (training and validation) and the learning rate per epoch.

    `history` maps metric names to one value per epoch; an `epoch` list gives the x axis
    (1, 2, ... when missing). Metrics that are absent are left out of their panel.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = [len(values) for key, values in history.items() if key != "epoch"]
    epochs = history.get("epoch") or list(range(1, max(lengths, default=0) + 1))
    figure = new_figure(figsize=(4.5 * len(TRAINING_PANELS), 3.5))
    axes = figure.subplots(1, len(TRAINING_PANELS))
    for axis, (title, keys) in zip(axes, TRAINING_PANELS.items()):
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
    temp.replace(path)
    return path


def confusion_matrix_png(matrix: np.ndarray, class_names: Sequence[str], title: str = "Confusion matrix") -> bytes:
    """A heat map of counts (rows = true class, columns = predicted class) with the count in each cell."""
    matrix = np.asarray(matrix)
    num_classes = len(class_names)
    if matrix.shape != (num_classes, num_classes):
        raise ValueError(f"matrix must be {num_classes}x{num_classes}, got shape {matrix.shape}")
    figure = new_figure(figsize=(7.5, 6.5))
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
    if count == 0:
        figure = new_figure(figsize=(4, 1.5))
        figure.suptitle(title)
        axes = figure.add_subplot()
        axes.text(0.5, 0.5, "no misclassified images", ha="center", va="center")
        axes.axis("off")
        return figure_png(figure)
    # One mosaic on one set of axes: with an axes per image (36 by default) this figure took 0.55 CPU-s, about a
    # third of evaluating the tests' tiny model in a flow run; the mosaic draws the same picture in 0.15.
    height, width = images.shape[1:3]
    gap, caption = width // 4, height // 4  # Pixels between images, and above each for its two-line title.
    cell_height, cell_width = caption + height + gap, width + gap
    mosaic = np.full((rows * cell_height, columns * cell_width, 3), 255, dtype=np.uint8)
    inches = 1.6 / cell_width  # Per mosaic pixel: each image 1.6 inches apart, as in a grid of axes.
    figure = new_figure(figsize=(mosaic.shape[1] * inches, mosaic.shape[0] * inches + 0.5))
    figure.suptitle(title)
    axes = figure.add_axes((0, 0, 1, mosaic.shape[0] * inches / (mosaic.shape[0] * inches + 0.5)))
    axes.axis("off")
    for position, (image, label, prediction) in enumerate(zip(images, labels, predictions)):
        row, column = divmod(position, columns)
        top, left = row * cell_height + caption, column * cell_width + gap // 2
        mosaic[top : top + height, left : left + width] = image
        axes.text(left + width / 2, top - 1, f"{class_names[int(label)]}\n/ {class_names[int(prediction)]}",
                  ha="center", va="bottom", fontsize=7)  # fmt: skip
    axes.imshow(mosaic, interpolation="nearest")
    return figure_png(figure)


def near_duplicates_png(
    groups: Sequence[tuple[str, Sequence[tuple[np.ndarray, np.ndarray, float]]]], title: str, columns: int = 6
) -> bytes:
    """A contact sheet of image pairs: per group a heading, then rows of (left | right) pairs and their similarity.

    `groups` are (heading, [(left image, right image, similarity), ...]), so a person can judge a
    threshold from the pairs just above and just below it. Drawn with PIL (a few milliseconds; a
    matplotlib figure of this many images takes seconds).
    """
    from PIL import Image, ImageDraw

    scale, gap, caption, heading = 3, 12, 14, 24  # Pixels: images shown 3x, so 32x32 becomes 96x96.
    cell_width, cell_height = 2 * 32 * scale + 4, 32 * scale + caption
    width = columns * (cell_width + gap) + gap
    rows = [max(1, math.ceil(len(pairs) / columns)) for _, pairs in groups]
    height = heading + sum(heading + count * (cell_height + gap) for count in rows) + gap
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((gap, 6), title, fill="black")
    top = heading
    for (text, pairs), count in zip(groups, rows):
        draw.text((gap, top + 6), text if pairs else f"{text}: none", fill="black")
        top += heading
        for position, (left, right, similarity) in enumerate(pairs):
            x = gap + (position % columns) * (cell_width + gap)
            y = top + (position // columns) * (cell_height + gap)
            pair = np.concatenate([left, np.full((32, 1, 3), 255, np.uint8), right], axis=1)  # (32, 65, 3)
            shown = Image.fromarray(pair).resize((cell_width, 32 * scale), Image.Resampling.NEAREST)
            sheet.paste(shown, (x, y))
            draw.text((x, y + 32 * scale + 1), f"{similarity:.3f}", fill="black")
        top += count * (cell_height + gap)
    buffer = io.BytesIO()
    sheet.save(buffer, format="PNG")
    return buffer.getvalue()


def drift_png(
    features: Mapping[str, tuple[Sequence[int] | None, Sequence[int], tuple[float, float], str]],
    classes: tuple[Sequence[int] | None, Sequence[int], str],
    class_names: Sequence[str],
    title: str,
) -> bytes:
    """Reference against current histograms, one panel per image feature and one for the predicted classes.

    `features` maps a feature name to (reference counts or None, current counts, (low, high) of the
    bins, subtitle with the measured value); `classes` is (reference counts or None, current counts,
    subtitle). Counts are drawn as shares, so sets of different sizes compare.
    """

    def shares(counts: Sequence[int]) -> np.ndarray:
        values = np.asarray(counts, np.float64)
        return values / values.sum() if values.sum() > 0 else values

    panels = len(features) + 1
    columns = 3
    rows = math.ceil(panels / columns)
    figure = new_figure(figsize=(4.2 * columns, 3.4 * rows + 0.6))
    figure.suptitle(title)
    for position, (name, (reference, current, (low, high), subtitle)) in enumerate(features.items()):
        axes = figure.add_subplot(rows, columns, position + 1)
        edges = np.linspace(low, high, len(current) + 1)
        if reference is not None:
            axes.stairs(shares(reference), edges, fill=True, alpha=0.35, color="tab:blue", label="reference")
        axes.stairs(shares(current), edges, linewidth=1.8, color="tab:orange", label="current")
        axes.set_title(f"{name}\n{subtitle}", fontsize=9)
        axes.set_xlabel(f"pixel units ({low:g}-{high:g})", fontsize=8)
        axes.set_ylabel("share of images", fontsize=8)
        axes.tick_params(labelsize=7)
        if position == 0:
            axes.legend(fontsize=7)
    reference, current, subtitle = classes
    axes = figure.add_subplot(rows, columns, panels)
    positions = np.arange(len(current))
    if reference is not None:
        axes.bar(positions - 0.2, shares(reference), width=0.4, color="tab:blue", alpha=0.6, label="reference")
    axes.bar(positions + 0.2, shares(current), width=0.4, color="tab:orange", label="current")
    axes.set_xticks(positions, labels=list(class_names), rotation=60, ha="right", fontsize=7)
    axes.set_title(f"predicted classes\n{subtitle}", fontsize=9)
    axes.set_ylabel("share of images", fontsize=8)
    axes.tick_params(axis="y", labelsize=7)
    # Every prediction job draws this: fixed margins and one draw (a tight layout or bounding box draws it
    # again, for seconds on a busy machine).
    figure.subplots_adjust(left=0.06, right=0.98, top=0.86, bottom=0.12, hspace=0.62, wspace=0.22)
    buffer = io.BytesIO()
    figure.canvas.print_png(buffer)
    return buffer.getvalue()


def reliability_png(before, after, temperature: float | None) -> bytes:
    """The reliability diagram: accuracy against confidence per bin, raw softmax and after temperature scaling.

    `before` and `after` are `cifar.calibration.ReliabilityBins`; bars show each bin's accuracy, the
    diagonal is perfect calibration, and each panel's title gives its ECE. Without a temperature (nothing
    held out to fit it on), the softmax panel alone."""
    panels = [(before, "softmax")]
    if temperature is not None:
        panels.append((after, f"temperature {temperature:.2f}"))
    figure = new_figure(figsize=(4.5 * len(panels), 4))
    for position, (bins, label) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), position + 1)
        edges = np.asarray(bins.edges)
        centres, width = (edges[:-1] + edges[1:]) / 2, edges[1] - edges[0]
        accuracy = np.nan_to_num(np.asarray(bins.accuracy))
        confidence = np.nan_to_num(np.asarray(bins.confidence))
        axes.bar(centres, accuracy, width=width * 0.95, color="tab:blue", alpha=0.8, label="accuracy")
        # Each bin's mean confidence as an outline: above the bar, over-confident; below it, under-confident.
        axes.bar(centres, confidence, width=width * 0.95, fill=False, edgecolor="tab:red", label="mean confidence")
        axes.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
        axes.set_xlim(0, 1)
        axes.set_ylim(0, 1)
        axes.set_xlabel("confidence (top probability)")
        axes.set_ylabel("accuracy")
        axes.set_title(f"{label}: ECE {100 * bins.expected_calibration_error:.2f} %", fontsize=10)
        if position == 0:
            axes.legend(fontsize=8, loc="upper left")
    figure.subplots_adjust(left=0.08, right=0.98, top=0.9, bottom=0.14, wspace=0.25)
    buffer = io.BytesIO()
    figure.canvas.print_png(buffer)
    return buffer.getvalue()


def corruption_heatmap_png(accuracy: Mapping[str, Sequence[float]], clean_accuracy: float) -> bytes:
    """Accuracy (%) per corruption (rows) and severity 1-5 (columns), with each row's mean and the clean figure."""
    names = list(accuracy)  # Top to bottom in the mapping's order (cifar.trust keeps the benchmark's).
    values = 100 * np.asarray([accuracy[name] for name in names], np.float64)
    figure = new_figure(figsize=(6.5, 0.38 * len(names) + 1.4))
    axes = figure.add_subplot(1, 1, 1)
    image = axes.imshow(values, cmap="viridis", vmin=0, vmax=100, aspect="auto")
    for row, column in np.ndindex(values.shape):
        shade = "white" if values[row, column] < 60 else "black"
        axes.text(column, row, f"{values[row, column]:.1f}", ha="center", va="center", fontsize=7, color=shade)
    axes.set_xticks(range(values.shape[1]), labels=[f"severity {s}" for s in range(1, values.shape[1] + 1)], fontsize=8)
    means = values.mean(axis=1)
    axes.set_yticks(range(len(names)), labels=[f"{n.replace('_', ' ')} ({m:.1f})" for n, m in zip(names, means)],
                    fontsize=8)  # fmt: skip
    axes.set_title(
        f"accuracy under corruption (%): mean {values.mean():.1f}, clean {100 * clean_accuracy:.1f}", fontsize=10
    )
    figure.subplots_adjust(left=0.3, right=0.86, top=0.93, bottom=0.06)
    colorbar = figure.colorbar(image, ax=axes, fraction=0.05, pad=0.03)
    colorbar.ax.tick_params(labelsize=7)
    buffer = io.BytesIO()
    figure.canvas.print_png(buffer)
    return buffer.getvalue()
