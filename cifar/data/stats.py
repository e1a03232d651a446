"""Per-channel mean/std of the training split and per-split class histograms, as numbers and parquet.

The mean and std come from exact integer sums of x and x^2 per channel, so they do not depend on
summation order or chunking: the same images always give the same bits in the manifest.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cifar.data.manifest import CLASS_HISTOGRAM_FILE, STATISTICS_FILE, Split

CHANNELS = ("red", "green", "blue")
SUM_CHUNK_PIXELS = 1 << 18  # Pixels per chunk: 256 KiB per channel plane, 512 KiB of squares.
PIXEL_MAX = 255.0  # Statistics are on the 0..1 scale the model's normalization layer uses.


def channel_statistics(images: np.ndarray) -> tuple[list[float], list[float]]:
    """Per-channel (R, G, B) mean and population std of uint8 HWC images, on the 0..1 scale."""
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3 or len(images) == 0:
        raise ValueError(f"expected non-empty uint8 (N, H, W, 3) images, got {images.dtype} {images.shape}")
    pixels = images.reshape(-1, 3)
    totals, squares = [0, 0, 0], [0, 0, 0]
    for start in range(0, len(pixels), SUM_CHUNK_PIXELS):  # Chunks that stay in cache.
        chunk = pixels[start : start + SUM_CHUNK_PIXELS]
        for channel in range(3):
            plane = np.ascontiguousarray(chunk[:, channel])
            totals[channel] += int(plane.sum(dtype=np.uint64))
            # 255^2 fits uint16, so squaring needs no wider temporary; the sum accumulates in uint64.
            squares[channel] += int(np.square(plane, dtype=np.uint16).sum(dtype=np.uint64))
    count = len(pixels)
    means = [total / count / PIXEL_MAX for total in totals]
    # Var = (n * sum(x^2) - sum(x)^2) / n^2, in exact integers before the one division.
    variances = [(count * square - total * total) / (count * count) for total, square in zip(totals, squares)]
    return means, [math.sqrt(variance) / PIXEL_MAX for variance in variances]


def write_statistics(output_dir: str | Path, mean: list[float], std: list[float], num_examples: int) -> Path:
    """Writes statistics.parquet: one row per channel (split, channel, mean, std, num_examples)."""
    table = pa.table(
        {
            "split": pa.array(["train"] * len(CHANNELS), pa.string()),
            "channel": pa.array(list(CHANNELS), pa.string()),
            "mean": pa.array(mean, pa.float64()),
            "std": pa.array(std, pa.float64()),
            "num_examples": pa.array([num_examples] * len(CHANNELS), pa.int64()),
        }
    )
    path = Path(output_dir) / STATISTICS_FILE
    pq.write_table(table, path)
    return path


def write_class_histogram(output_dir: str | Path, splits: dict[str, Split], class_names: list[str]) -> Path:
    """Writes class_histogram.parquet: one row per (split, class) with the example count."""
    rows = [
        (split, class_id, class_names[class_id], count)
        for split, entry in splits.items()
        for class_id, count in enumerate(entry.class_counts)
    ]
    table = pa.table(
        {
            "split": pa.array([row[0] for row in rows], pa.string()),
            "class_id": pa.array([row[1] for row in rows], pa.int64()),
            "class_name": pa.array([row[2] for row in rows], pa.string()),
            "count": pa.array([row[3] for row in rows], pa.int64()),
        }
    )
    path = Path(output_dir) / CLASS_HISTOGRAM_FILE
    pq.write_table(table, path)
    return path
