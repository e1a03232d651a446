"""Test accuracy split by provenance: original-pixel test images vs JPEG-degraded ones.

The offline archive (`../shared/data/`) rebuilt CIFAR-10 from public copies: 4,593 test images carry
the original pixels, the other 5,407 were decoded from quality-75 JPEGs. Its provenance file holds the
boolean masks. Given evaluation outputs (`runs/<run>/evaluation/predictions.parquet`, one row per
test image in the official order), this prints the accuracy on each part, single view and flip TTA.

    .venv/bin/python bench/jpeg_split.py /tmp/fast*/runs/*/evaluation/predictions.parquet
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

DEFAULT_PROVENANCE = common.DEFAULT_ARCHIVE.parent / "cifar-10-provenance.npz"


def accuracy_by_provenance(predictions_path: str | Path, exact: np.ndarray) -> dict[str, float]:
    """Accuracy on all, original-pixel and JPEG test images (single view; flip TTA when recorded)."""
    table = pq.read_table(predictions_path).to_pydict()
    if len(table["correct"]) != len(exact):
        raise ValueError(f"{predictions_path} has {len(table['correct'])} rows, the provenance mask {len(exact)}")
    correct = np.asarray(table["correct"], dtype=bool)
    result = {"all": correct.mean(), "exact": correct[exact].mean(), "jpeg": correct[~exact].mean()}
    if "predicted_flip_tta" in table:
        flip = np.asarray(table["predicted_flip_tta"]) == np.asarray(table["label"])
        result |= {"exact_flip": flip[exact].mean(), "jpeg_flip": flip[~exact].mean()}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("predictions", nargs="+", help="predictions.parquet files of test-split evaluations")
    parser.add_argument("--provenance", default=str(DEFAULT_PROVENANCE), help="npz with the test_exact mask")
    args = parser.parse_args(argv)
    with np.load(args.provenance, allow_pickle=False) as masks:
        exact = masks["test_exact"].astype(bool)
    print(f"| predictions | all | original pixels ({exact.sum():,}) | JPEG ({(~exact).sum():,}) | "
          "original, flip TTA | JPEG, flip TTA |")
    print("|---|---:|---:|---:|---:|---:|")
    for path in args.predictions:
        row = accuracy_by_provenance(path, exact)
        cells = [row["all"], row["exact"], row["jpeg"], row.get("exact_flip"), row.get("jpeg_flip")]
        print(f"| {path} | " + " | ".join("-" if value is None else f"{100 * value:.2f} %" for value in cells) + " |")


if __name__ == "__main__":
    main()
