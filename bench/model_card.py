"""How long a version's model card takes at registration, on the real test set.

    python bench/model_card.py [ARCHIVE] [--repeats 3] [--write-docs]

What it measures: METHOD below, which also opens its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from unittest import mock

import common

from cifar import model_card
from cifar.config import make_config
from cifar.evaluate import evaluate, load_split
from cifar.export import export_model
from cifar.model_card import robustness
from cifar.registry import register_and_promote
from cifar.train import train

HEADING = "## Model card generation"
# What is measured, the opening of its section of docs/BENCHMARKS.md.
METHOD = """\
A smoke-preset model (the tutorial CNN, 2 epochs of 60 steps) is trained once on the real archive;
then, interleaved, the register stage registers its export (a fresh SQLite store each time) without
the card and with it (`evaluation` given), and the card's parts are timed on their own: the
robustness section (the 10,000 test images under five perturbations, through the SavedModel) and
the rest (the provenance split, Markdown, HTML, files and the MLflow artifacts). The register stage's
card takes the first `export.card_robustness_examples` test images (2,000). The baseline beside it: the
robustness section as it was before 2026-11-28, its JPEG perturbation run eagerly (`tf.map_fn` calling
Python for each image) instead of as one traced graph.
"""


def predictor(export_dir: str):
    """uint8 images -> class ids through the SavedModel's serving signature."""
    import tensorflow as tf

    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    return lambda batch: serve(images=tf.constant(batch))["class_ids"].numpy()


def eager_jpeg_50():
    """The JPEG-50 perturbation before 2026-11-28: tf.map_fn run eagerly (the same bytes, Python per image)."""
    import tensorflow as tf

    return lambda pixels: tf.map_fn(lambda image: tf.image.adjust_jpeg_quality(image, 50), pixels)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archive", nargs="?", default=str(common.DEFAULT_ARCHIVE))
    parser.add_argument("--workdir", default=str(common.DEFAULT_BENCH_WORKDIR / "model-card"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--note", default=None, help="A note on the machine's state, added to the docs.")
    return parser.parse_args(argv)


def measure(args) -> dict[str, list[float]]:
    """A smoke model trained once, then the register stage without and with the card, interleaved, and the
    card's robustness section alone: seconds of each run."""
    workdir = Path(args.workdir)
    data_dir = common.prepare_bench_data(args.archive, workdir)
    config = make_config("smoke", {"tracking": {"system_metrics": False}})
    training = train(config, data_dir, workdir)
    evaluation = evaluate(config, data_dir, training.checkpoint_dir, workdir)
    export = export_model(config, data_dir, training.checkpoint_dir, workdir, evaluation)
    times: dict[str, list[float]] = {"without": [], "with": [], "robustness": [], "robustness_eager": []}
    for repeat in range(args.repeats):
        for variant in ("without", "with") if repeat % 2 == 0 else ("with", "without"):
            store = workdir / f"store-{repeat}-{variant}"
            # A new store each time (a store left by an earlier run holds the version: the stage would reuse it).
            Path(f"{store}.db").unlink(missing_ok=True)
            run_config = config.model_copy(
                update={"tracking": config.tracking.model_copy(update={"tracking_uri": f"sqlite:///{store}.db"})}
            )
            start = time.perf_counter()
            register_and_promote(
                run_config,
                export.model_copy(update={"key": f"bench-{repeat}-{variant}"}),
                data_dir,
                evaluation=evaluation if variant == "with" else None,
            )
            times[variant].append(time.perf_counter() - start)
        images, labels = load_split(data_dir, "test")
        for variant in ("robustness", "robustness_eager") if repeat % 2 == 0 else ("robustness_eager", "robustness"):
            with mock.patch.object(
                model_card, "_jpeg_50", eager_jpeg_50 if variant == "robustness_eager" else model_card._jpeg_50
            ):
                start = time.perf_counter()
                robustness(predictor(export.export_dir), images, labels)
                times[variant].append(time.perf_counter() - start)
    return times


def docs_body(args, argv, load_at_start: str, times: dict[str, list[float]]) -> str:
    """The section of docs/BENCHMARKS.md: the method, the table, what the card costs."""
    medians = {name: common.median(values) for name, values in times.items()}
    card = medians["with"] - medians["without"]
    return "\n".join(
        [
            METHOD.strip(),
            "",
            f"Command: `{common.command_line('model_card.py', argv)}`",
            "",
            f"Machine: {common.machine_description(load_at_start)}. Note: {args.note or common.SHARED_NOTE}.",
            "",
            "| measurement | median wall s | runs, wall s |",
            "|---|---:|---|",
            *[
                f"| {label} | {medians[name]:.2f} | {', '.join(f'{value:.2f}' for value in times[name])} |"
                for name, label in (
                    ("without", "register stage without the card (log, register, judge)"),
                    ("with", "register stage with the card"),
                    ("robustness", "the card's robustness section alone (5 x 10,000 perturbed test images)"),
                    ("robustness_eager", "the same, JPEG run eagerly (before 2026-11-28): the baseline"),
                )
            ],
            "",
            f"The card adds {card:.1f} s to the register stage ({100 * card / medians['without']:.0f} % of it; its "
            "robustness section on the first 2,000 test images). The robustness section on all 10,000 images takes "
            f"{medians['robustness']:.1f} s, {medians['robustness'] / medians['robustness_eager']:.2f}x the eager "
            f"JPEG's {medians['robustness_eager']:.1f} s.",
        ]
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    load_at_start = common.load_average()
    body = docs_body(args, argv, load_at_start, measure(args))
    print(body)
    if args.write_docs:
        common.write_section(HEADING, body)


if __name__ == "__main__":
    main()
