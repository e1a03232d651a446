"""What the archive's JPEG-decoded images cost in test accuracy, measured two ways (split and controlled).

    .venv/bin/python bench/jpeg_split.py /tmp/fast*/runs/*/evaluation/predictions.parquet \
        --checkpoint /tmp/fast0/runs/*/checkpoints/epoch-0016.keras

Why two ways, and what each compares: docs/BENCHMARKS.md, "How each benchmark measures".
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

DEFAULT_PROVENANCE = common.DEFAULT_ARCHIVE.parent / common.PROVENANCE_FILE
JPEG_QUALITY = 75  # The archive's README: "decoded from a JPEG (quality 75) copy of the original".
FIRST_BLOCK = 1000  # The first 1,000 test images are all original pixels, every class.
CLASS_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def test_subsets(exact: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """Boolean masks over the test set: original pixels, JPEG-decoded, the first 1,000, and a class-matched part.

    The class-matched part is the original-pixel images of the classes that also have JPEG images (in
    this archive the animal classes of the first 1,000), so it compares with the JPEG part class for class.
    """
    first = np.arange(len(exact)) < FIRST_BLOCK
    shared_classes = np.intersect1d(labels[exact], labels[~exact])
    class_matched = exact & np.isin(labels, shared_classes)
    return {
        f"original pixels ({exact.sum():,})": exact,
        f"JPEG ({(~exact).sum():,})": ~exact,
        f"first {FIRST_BLOCK:,} (original, all classes)": first & exact,
        f"original, the JPEG part's classes ({class_matched.sum():,})": class_matched,
    }


def class_makeup(labels: np.ndarray, subsets: dict[str, np.ndarray]) -> str:
    """A markdown table: how many images of each class every subset holds."""
    lines = ["| subset | " + " | ".join(CLASS_NAMES) + " |", "|---|" + "---:|" * len(CLASS_NAMES)]
    for name, mask in subsets.items():
        counts = np.bincount(labels[mask], minlength=len(CLASS_NAMES))
        lines.append(f"| {name} | " + " | ".join(f"{count:,}" for count in counts) + " |")
    return "\n".join(lines)


def read_predictions(path: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """The labels and the correctness of each view (single, and flip TTA where present) in a predictions file."""
    table = pq.read_table(path).to_pydict()
    labels = np.asarray(table["label"], dtype=np.int64)
    views = [np.asarray(table["correct"], dtype=bool)]
    if "predicted_flip_tta" in table:
        views.append(np.asarray(table["predicted_flip_tta"], dtype=np.int64) == labels)
    return labels, views


def split_table(predictions: dict[str, list[np.ndarray]], subsets: dict[str, np.ndarray]) -> str:
    """Markdown rows of accuracy per subset (single view / flip TTA) for every predictions file's views."""
    lines = ["| predictions | all | " + " | ".join(subsets) + " |", "|---|---:|" + "---:|" * len(subsets)]
    for path, views in predictions.items():
        masks = [np.ones(len(views[0]), dtype=bool), *subsets.values()]
        cells = [" / ".join(f"{100 * view[mask].mean():.2f}" for view in views) + " %" for mask in masks]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Cells: single view / flip TTA (where the predictions file has it).")
    return "\n".join(lines)


def read_all_predictions(paths: list[str], exact: np.ndarray) -> tuple[np.ndarray, dict[str, list[np.ndarray]]]:
    """The shared test labels and each file's views, checking every file holds the same test images in order."""
    labels, views = read_predictions(paths[0])
    if len(labels) != len(exact):
        raise ValueError(f"{paths[0]} has {len(labels)} rows, the provenance mask {len(exact)}")
    all_views = {paths[0]: views}
    for path in paths[1:]:
        file_labels, all_views[path] = read_predictions(path)
        if not np.array_equal(file_labels, labels):
            raise ValueError(f"{path} does not hold the same test images in the same order as {paths[0]}")
    return labels, all_views


def jpeg_round_trip(images: np.ndarray, quality: int = JPEG_QUALITY) -> np.ndarray:
    """Every uint8 HWC image encoded as a JPEG with Pillow's defaults (4:2:0 chroma) and decoded again."""
    decoded = np.empty_like(images)
    for index, image in enumerate(images):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
        buffer.seek(0)
        with Image.open(buffer) as reopened:
            decoded[index] = np.asarray(reopened.convert("RGB"))
    return decoded


def controlled_table(checkpoints: list[str], images: np.ndarray, labels: np.ndarray, exact: np.ndarray) -> str:
    """Accuracy of each checkpoint on original-pixel images as they are and after a JPEG round trip."""
    import keras

    import cifar.layers  # noqa: F401  (registers the custom layers the checkpoints name)
    import cifar.optimizers  # noqa: F401

    # Only the original-pixel images are scored, so every part is a mask over them.
    parts = {
        name.partition(" (")[0]: mask[exact]
        for name, mask in test_subsets(exact, labels).items()
        if not (mask & ~exact).any()
    }
    originals, original_labels = images[exact], labels[exact]
    degraded = jpeg_round_trip(originals)
    change = np.abs(degraded.astype(np.int16) - originals).mean()
    rejpeg = np.abs(jpeg_round_trip(images[~exact]).astype(np.int16) - images[~exact]).mean()
    lines = [
        f"JPEG q{JPEG_QUALITY} round trip: mean absolute change {change:.2f}/255 on the original-pixel images, "
        f"{rejpeg:.2f}/255 on the archive's JPEG images (already degraded).",
        "",
        "| checkpoint | " + " | ".join(f"{name}: as given | after JPEG | cost" for name in parts) + " |",
        "|---|" + "---:|---:|---:|" * len(parts),
    ]
    for path in checkpoints:
        model = keras.models.load_model(path, compile=False)
        original = model.predict(originals, batch_size=500, verbose=0).argmax(axis=1) == original_labels
        jpeg = model.predict(degraded, batch_size=500, verbose=0).argmax(axis=1) == original_labels
        cells = []
        for mask in parts.values():
            before, after = 100 * original[mask].mean(), 100 * jpeg[mask].mean()
            cells += [f"{before:.2f} %", f"{after:.2f} %", f"{after - before:+.2f}"]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("predictions", nargs="*", help="predictions.parquet files of test-split evaluations")
    parser.add_argument("--checkpoint", action="append", default=[], help=".keras checkpoint (repeatable)")
    parser.add_argument("--provenance", default=str(DEFAULT_PROVENANCE), help="npz with the test_exact mask")
    parser.add_argument("--archive", default=str(common.DEFAULT_ARCHIVE), help="the archive (for --checkpoint)")
    args = parser.parse_args(argv)
    if not args.predictions and not args.checkpoint:
        parser.error("give predictions files, --checkpoint, or both")
    exact = common.exact_test_images(args.provenance)
    if args.predictions:
        labels, views = read_all_predictions(args.predictions, exact)
        subsets = test_subsets(exact, labels)
        print(split_table(views, subsets), end="\n\n")
        print(class_makeup(labels, subsets), end="\n\n")
    if args.checkpoint:
        from cifar.data.archive import read_archive

        dataset = read_archive(args.archive)
        if len(dataset.test_labels) != len(exact):
            raise ValueError(f"{args.archive} has {len(dataset.test_labels)} test images, the mask {len(exact)}")
        print(controlled_table(args.checkpoint, dataset.test_images, dataset.test_labels, exact))


if __name__ == "__main__":
    main()
