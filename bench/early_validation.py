"""Validation in the first epochs of a ResNet recipe, with the moving batch-norm averages and with precise BN.

Trains the first epochs of each preset twice from the same seed on the shared archive, once with
`train.precise_bn_images=0` (validation on the moving averages) and once with the preset's default,
and plots validation accuracy and loss per epoch side by side (docs/images/early-validation.png).

    .venv/bin/python bench/early_validation.py --presets default full --epochs 3 --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

SECTION = "## Early validation: moving averages against precise BN"
PLOT = common.REPO_ROOT / "docs" / "images" / "early-validation.png"


def train_first_epochs(preset: str, precise_bn_images: int | None, epochs: int, data_dir: Path, workdir: Path) -> dict:
    """The preset's first `epochs` epochs (its full schedule, stopped early); returns the history and the time."""
    import keras

    from cifar.config import make_config
    from cifar.train import train

    class StopAfter(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = epoch + 1 >= epochs

    overrides = {"train": {"resume": False}, "tracking": {"system_metrics": False}}
    if precise_bn_images is not None:
        overrides["train"]["precise_bn_images"] = precise_bn_images
    config = make_config(preset, overrides)
    start = time.perf_counter()
    result = train(config, data_dir, workdir, callbacks=[StopAfter()])
    history = json.loads((Path(result.run_dir) / "history.json").read_text())
    return {"history": history, "seconds": time.perf_counter() - start, "model": config.train.model}


def plot(results: dict[str, dict[str, dict]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(results), 2, figsize=(10, 3.4 * len(results)), squeeze=False)
    for row, (preset, variants) in enumerate(results.items()):
        for label, run in variants.items():
            history = run["history"]
            epochs = history["epoch"]
            axes[row][0].plot(epochs, [100 * v for v in history["val_accuracy"]], marker="o", label=f"val, {label}")
            axes[row][1].semilogy(epochs, history["val_loss"], marker="o", label=f"val, {label}")
        train_history = next(iter(variants.values()))["history"]
        axes[row][0].plot(train_history["epoch"], [100 * v for v in train_history["accuracy"]], "k--", label="train")
        axes[row][0].axhline(10, color="grey", linewidth=0.8)  # Chance.
        model = next(iter(variants.values()))["model"]
        axes[row][0].set(title=f"{preset} ({model}): accuracy %", xlabel="epoch")
        axes[row][1].set(title=f"{preset} ({model}): validation loss", xlabel="epoch")
        for axis in axes[row]:
            axis.legend(fontsize=8)
            axis.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    return path


def table(results: dict[str, dict[str, dict]]) -> str:
    lines = [
        "| preset | epoch | train accuracy | val accuracy, moving averages | val loss "
        "| val accuracy, precise BN | val loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for preset, variants in results.items():
        before, after = variants["moving averages"]["history"], variants["precise BN"]["history"]
        for index, epoch in enumerate(before["epoch"]):
            lines.append(
                f"| {preset} | {epoch} | {100 * before['accuracy'][index]:.1f} % "
                f"| {100 * before['val_accuracy'][index]:.1f} % | {before['val_loss'][index]:,.2f} "
                f"| {100 * after['val_accuracy'][index]:.1f} % | {after['val_loss'][index]:,.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["default", "full"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--archive", type=Path, default=common.DEFAULT_ARCHIVE)
    parser.add_argument("--workdir", type=Path, default=common.DEFAULT_BENCH_WORKDIR / "early-validation")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    load = common.load_average()
    data_dir = common.prepare_bench_data(args.archive, args.workdir)
    results: dict[str, dict[str, dict]] = {}
    for preset in args.presets:
        results[preset] = {}
        for label, images in (("moving averages", 0), ("precise BN", None)):
            run = train_first_epochs(preset, images, args.epochs, data_dir, args.workdir / f"{preset}-{images}")
            results[preset][label] = run
            print(f"{preset}, {label}: {run['seconds']:.0f} s", flush=True)
    path = plot(results, PLOT)
    body = table(results)
    print(body)
    if args.write_docs:
        seconds = ", ".join(
            f"{preset} {label} {run['seconds'] / 60:.1f} min"
            for preset, v in results.items()
            for label, run in v.items()
        )
        common.write_section(
            SECTION,
            f"`{common.command_line('early_validation.py', argv)}`; {common.machine_description(load)}. "
            f"Each preset's first {args.epochs} epochs of its own schedule, the same seed twice; wall time: "
            f"{seconds}.\n\n{body}\n\n![Early validation curves](images/{path.name})",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
