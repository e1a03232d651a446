"""Calibration and CIFAR-10-C robustness of a trained run's best checkpoint, and what measuring them costs.

    python bench/robustness.py WORKDIR [--run NAME] [--subset 2000 | --subset all] [--output DIR]

WORKDIR is a pipeline workdir whose summary names the prepared data (the real archive's) and a run with
checkpoints (`python flows/pipeline.py --preset fast --until train` makes one). Prints and writes (DIR,
default WORKDIR/robustness/): report.json with the temperature fitted on the validation split, test-split
ECE/NLL/Brier before and after it, accuracy at 50/80/90/95 % coverage, accuracy per corruption and
severity on the subset with their mean and the drop from clean; reliability.png, corruptions.png; and the
seconds each part took (corrupting, scoring), with the machine named.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import common
import numpy as np

from cifar import calibration, corruptions, plots, robustness
from cifar.checkpoints import load_index, select_for_evaluation
from cifar.evaluate import checkpoint_logits, load_split
from cifar.io import atomic_write_bytes, atomic_write_json, read_json

BATCH = 1000


def two_fold_on_test(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """For this figure only, where nothing was held out: what a temperature would do, fitted on one half of the
    test split (even or odd images) and measured on the other. The pipeline never fits on the test set."""
    halves = [np.arange(len(labels))[parity::2] for parity in (0, 1)]
    temperatures = [calibration.fit_temperature(logits[half], labels[half]) for half in halves]
    scaled = np.empty((len(labels), logits.shape[1]))
    for half, other_temperature in zip(halves, reversed(temperatures)):
        scaled[half] = calibration.softmax(logits[half], other_temperature)
    return {"temperatures": temperatures, **calibration.measures(scaled, labels)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--run", help="the run folder under WORKDIR/runs (default: the summary's)")
    parser.add_argument("--subset", default=str(robustness.DEFAULT_SUBSET), help="test images per corruption, or 'all'")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    load_at_start = common.load_average()
    summary = read_json(args.workdir / "summary.json")
    data_dir = summary["data"]["data_dir"]
    run_dir = args.workdir / "runs" / args.run if args.run else Path(summary["training"]["run_dir"])
    output = args.output or args.workdir / "robustness"
    subset = None if args.subset == "all" else int(args.subset)

    checkpoint_dir = run_dir / "checkpoints"
    entry = select_for_evaluation(load_index(checkpoint_dir), "best")[0]
    logits = checkpoint_logits(checkpoint_dir, entry, BATCH)  # As the evaluate stage scores it.

    started = time.perf_counter()
    validation_images, validation_labels = load_split(data_dir, "validation")
    test_images, test_labels = load_split(data_dir, "test")
    # A preset that holds nothing out (fast: all 50,000 images train) has nothing to fit a temperature on:
    # the test set is never used for it, so its probabilities are reported as they are (T = 1).
    fitted = len(validation_labels) > 0
    temperature = calibration.fit_temperature(logits(validation_images), validation_labels) if fitted else 1.0
    test_logits = logits(test_images)
    report = calibration.calibration_report(test_logits, test_labels, temperature)
    calibration_seconds = time.perf_counter() - started
    cross_fitted = None if fitted else two_fold_on_test(test_logits, test_labels)

    chosen = robustness.subset_indices(len(test_labels), subset)
    timings: dict[str, float] = {"corrupting": 0.0, "scoring": 0.0}

    def timed_logits(images: np.ndarray) -> np.ndarray:
        begin = time.perf_counter()
        answer = logits(images)
        timings["scoring"] += time.perf_counter() - begin
        return answer

    def progress(name: str, done: int, total: int) -> None:
        print(f"  {done:2d}/{total} {name}", file=sys.stderr, flush=True)

    begin = time.perf_counter()
    cache = output / "cache"
    measured = robustness.measure(
        timed_logits, test_images[chosen], test_labels[chosen], cache_dir=cache, progress=progress
    )
    total = time.perf_counter() - begin
    timings["corrupting"] = total - timings["scoring"]

    machine = common.machine_description(load_at_start)
    result = {
        "machine": machine,
        "run": run_dir.name,
        "checkpoint_epoch": entry.epoch,
        "calibration": {
            "temperature": report.temperature,
            "fitted_on": f"validation split ({len(validation_labels):,} images)" if fitted else "nothing held out",
            "before": report.before,
            "after": report.after,
            "selective_accuracy": dict(zip(map(str, report.selective.coverages), report.selective.accuracy)),
            "seconds": calibration_seconds,
            "two_fold_on_test_for_illustration": cross_fitted,
        },
        "robustness": {**measured.to_json(), "seconds": total, **{f"{k}_seconds": v for k, v in timings.items()}},
    }
    atomic_write_json(output / "report.json", result)
    atomic_write_bytes(
        output / "reliability.png",
        plots.reliability_png(report.reliability_before, report.reliability_after, temperature if fitted else None),
    )
    atomic_write_bytes(
        output / "corruptions.png", plots.corruption_heatmap_png(measured.accuracy, measured.clean_accuracy)
    )
    print(json.dumps({k: v for k, v in result.items() if k != "robustness"}, indent=1))
    print(f"clean {measured.clean_accuracy:.4f} mean corruption {measured.mean_corruption_accuracy:.4f} "
          f"drop {measured.drop:.4f} on {measured.images} images; {total:.0f} s "
          f"(corrupting {timings['corrupting']:.0f} s, scoring {timings['scoring']:.0f} s); {machine}")  # fmt: skip
    for name in corruptions.CORRUPTIONS:
        print(f"  {name:18s} " + " ".join(f"{value:.3f}" for value in measured.accuracy[name]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
