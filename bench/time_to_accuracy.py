"""Time to accuracy, side by side: the SGD recipes against the Muon recipes that replaced them (issue 27).

    .venv/bin/python bench/time_to_accuracy.py --write-docs        # the sitting: fast-sgd vs fast, then sprint
    .venv/bin/python bench/time_to_accuracy.py --presets fast --candidate-set train.epochs=11 \
        --candidate-set train.warmup_epochs=2.53                   # a candidate against fast-sgd, no config edit
    .venv/bin/python bench/time_to_accuracy.py run --preset fast --seed 0 --set train.epochs=10 --results FILE
    .venv/bin/python bench/time_to_accuracy.py table FILE          # one row per recorded run (ablations)

The sitting, its order and what is measured per run: docs/BENCHMARKS.md, "How each benchmark measures".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import common  # noqa: E402

HEADING = "## Time to accuracy: Muon against SGD, side by side"  # + presets and candidate: a section per sitting.
PAIRS = (("fast-sgd", "fast"), ("sprint-sgd", "sprint"))  # (old recipe, new recipe), in sitting order.
DEFAULT_SEEDS = (0, 1, 2)
ACCEPTED_TIME_RATIO = 0.8  # Issue 27: the new recipe trains in at most 0.8x the old one's time (aim: 0.7x).
DEFAULT_WORKDIR = common.DEFAULT_BENCH_WORKDIR / "time-to-accuracy"
ACCURACIES = (("test_accuracy", "test"), ("flip_tta_accuracy", "flip TTA"), ("tta_accuracy", "flip+translate TTA"))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archive", default=str(common.DEFAULT_ARCHIVE), help="The real CIFAR-10 archive.")
    parser.add_argument("--sha256", default=None, help="The archive's SHA-256 (default: the offline archive's).")
    parser.add_argument("--workdir", default=str(DEFAULT_WORKDIR), help="Prepared data, run folders, results.")
    parser.add_argument("--keep-runs", action="store_true", help="Keep each run's folder (checkpoints) afterwards.")
    commands = parser.add_subparsers(dest="command")

    run = commands.add_parser("run", help="Train and evaluate one run in this process; append its record.")
    run.add_argument("--preset", required=True)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="Config override.")
    run.add_argument("--label", default="", help="What this run tries (for the ablation table).")
    run.add_argument("--results", default=None, help="The JSON-lines file to append to (default: WORKDIR/...).")

    table = commands.add_parser("table", help="Print one markdown row per recorded run.")
    table.add_argument("results", help="A JSON-lines file written by `run` or by the sitting.")

    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS), help="The sitting's seeds.")
    parser.add_argument(
        "--presets", nargs="+", choices=[new for _, new in PAIRS], default=[new for _, new in PAIRS],
        help="Which pairs the sitting runs (each against its -sgd recipe).",
    )  # fmt: skip
    parser.add_argument(
        "--candidate-set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="An override of the new recipe's runs (repeatable): measure a candidate without editing the presets.",
    )  # fmt: skip
    parser.add_argument("--write-docs", action="store_true", help=f"Write the table into {common.DOCS_PATH}.")
    parser.add_argument("--note", default="", help="A note on the machine's state (e.g. quiet, shared).")
    return parser.parse_args(argv)


def results_path(args: argparse.Namespace) -> Path:
    return Path(getattr(args, "results", None) or Path(args.workdir) / "sitting.jsonl")


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Trains and evaluates one configuration in this process; appends and returns its record."""
    sys.path.insert(0, str(common.REPO_ROOT))
    from cifar.config import make_config
    from cifar.evaluate import evaluate
    from cifar.train import train
    from flows.cli import parse_overrides

    workdir = Path(args.workdir)
    overrides = parse_overrides(args.set)
    archive = Path(args.archive).expanduser().resolve()
    data_dir = common.prepare_bench_data(archive, workdir, args.sha256)
    run_name = f"{args.preset}-seed{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides.setdefault("train", {})["run_name"] = run_name
    config = make_config(args.preset, {**overrides, "seed": args.seed})
    load_at_start = common.load_average()
    started = time.perf_counter()
    result = train(config, data_dir, workdir, refresh=True)
    training_seconds = time.perf_counter() - started
    evaluation = evaluate(config, data_dir, result.checkpoint_dir, workdir, refresh=True)
    history = json.loads((Path(result.run_dir) / "history.json").read_text())
    overrides["train"].pop("run_name")
    record = {
        "label": args.label,
        "preset": args.preset,
        "seed": args.seed,
        "overrides": {key: value for key, value in overrides.items() if value},
        "epochs": result.epochs_completed,
        "batch_size": config.train.batch_size,
        "optimizer": config.train.optimizer,
        "training_seconds": round(training_seconds, 1),
        "epoch_seconds": round(sum(value for value in history.get("epoch_seconds", []) if value), 1),
        "images_per_second": round(statistics.median(history["examples_per_second"]), 1),
        **{name: getattr(evaluation, name) for name, _ in ACCURACIES},
        "load_average_start": load_at_start,
        "load_average_end": common.load_average(),
        "cpu": common.cpu_model(),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if not args.keep_runs:
        shutil.rmtree(result.run_dir, ignore_errors=True)
    path = results_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    print(json.dumps(record, indent=2))
    return record


def sitting_order(seeds: Sequence[int], presets: Sequence[str]) -> list[tuple[str, int]]:
    """(preset, seed) in the sitting's order: pair by pair, seed by seed, old and new alternating first."""
    order = []
    for old, new in PAIRS:
        if new not in presets:
            continue
        for position, seed in enumerate(seeds):
            pair = (old, new) if position % 2 == 0 else (new, old)
            order += [(preset, seed) for preset in pair]
    return order


def candidate_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The overrides the sitting applies to the new recipe's runs (as their records store them)."""
    sys.path.insert(0, str(common.REPO_ROOT))
    from flows.cli import parse_overrides

    return parse_overrides(args.candidate_set)


def sitting_overrides(preset: str, candidate: dict[str, Any]) -> dict[str, Any]:
    """A run's overrides in the sitting: the candidate's for the new recipes, none for the old."""
    return candidate if preset in {new for _, new in PAIRS} else {}


def run_sitting(args: argparse.Namespace, candidate: dict[str, Any]) -> None:
    """Every run of the sitting not yet recorded, one fresh process each, in `sitting_order`."""
    path = results_path(args)
    done = {(record["preset"], record["seed"], json.dumps(record["overrides"], sort_keys=True))
            for record in read_records(path)}  # fmt: skip
    common_arguments = ["--archive", args.archive, "--workdir", args.workdir]
    if args.sha256:
        common_arguments += ["--sha256", args.sha256]
    if args.keep_runs:
        common_arguments.append("--keep-runs")
    for preset, seed in sitting_order(args.seeds, args.presets):
        overrides = sitting_overrides(preset, candidate)
        if (preset, seed, json.dumps(overrides, sort_keys=True)) in done:
            print(f"=== {preset} seed {seed}: already recorded in {path}")
            continue
        print(f"=== {preset} seed {seed} (load average {common.load_average()})", flush=True)
        command = [sys.executable, __file__, *common_arguments, "run", "--preset", preset, "--seed", str(seed)]
        command += [f"--set={assignment}" for assignment in (args.candidate_set if overrides else [])]
        subprocess.run([*command, "--results", str(path)], check=True, cwd=common.REPO_ROOT)


def mean_std(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
    values = [value * scale for value in values]
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {spread:.{digits}f}"


def describe_overrides(overrides: dict[str, Any]) -> str:
    """`{"train": {"epochs": 12}}` -> `train.epochs=12`."""
    return ", ".join(
        f"{section}.{key}={json.dumps(value)}" if key else f"{section}={json.dumps(value)}"
        for section, fields in overrides.items()
        for key, value in (fields.items() if isinstance(fields, dict) else [("", fields)])
    )


def sitting_table(records: list[dict[str, Any]], seeds: Sequence[int], candidate: dict[str, Any] | None = None) -> str:
    """Per pair: one row per run, then mean ± std per recipe and the training-time ratio new / old.

    The new recipe's rows are the runs with the `candidate` overrides, the old recipe's those without any.
    """
    lines = [
        "| recipe | optimizer | seed | epochs | training | the epochs' own | images/s | test | flip TTA "
        "| flip+translate TTA |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary = []
    for old, new in PAIRS:
        by_preset = {
            preset: sorted(
                (
                    record
                    for record in records
                    if record["preset"] == preset
                    and record["seed"] in seeds
                    and record["overrides"] == sitting_overrides(preset, candidate or {})
                ),
                key=lambda record: record["seed"],
            )
            for preset in (old, new)
        }
        if not all(by_preset.values()):
            continue
        for preset, rows in by_preset.items():
            overrides = sitting_overrides(preset, candidate or {})
            recipe = f"`{preset}`" + (" + candidate" if overrides else "")
            for row in rows:
                accuracies = " | ".join(f"{100 * row[name]:.2f} %" for name, _ in ACCURACIES)
                lines.append(
                    f"| {recipe} | {row['optimizer']} | {row['seed']} | {row['epochs']} | "
                    f"{row['training_seconds'] / 60:.1f} min | {row['epoch_seconds'] / 60:.1f} min | "
                    f"{row['images_per_second']:,.0f} | {accuracies} |"
                )
            accuracies = " | ".join(f"**{mean_std([r[name] for r in rows], 100)} %**" for name, _ in ACCURACIES)
            minutes = mean_std([r["training_seconds"] / 60 for r in rows], digits=1)
            epochs_own = mean_std([r["epoch_seconds"] / 60 for r in rows], digits=1)
            lines.append(
                f"| **{recipe}, mean ± std** | {rows[0]['optimizer']} | | {rows[0]['epochs']} | **{minutes} min** | "
                f"{epochs_own} min | | {accuracies} |"
            )
        old_rows, new_rows = by_preset[old], by_preset[new]

        def mean_of(rows: list[dict[str, Any]], name: str) -> float:
            return statistics.mean(row[name] for row in rows)

        ratio = mean_of(new_rows, "training_seconds") / mean_of(old_rows, "training_seconds")
        epochs_ratio = mean_of(new_rows, "epoch_seconds") / mean_of(old_rows, "epoch_seconds")
        gain = mean_of(new_rows, "tta_accuracy") - mean_of(old_rows, "tta_accuracy")
        # Issue 27's acceptance: at least the old mean accuracy, in at most 0.8x the old training time.
        verdict = "met" if gain >= 0 and ratio <= ACCEPTED_TIME_RATIO else "not met"
        name = f"`{new}`" + (" + candidate" if candidate else "")
        summary.append(
            f"- {name} against `{old}`: **{ratio:.2f}×** the training time ({epochs_ratio:.2f}× the epochs' own "
            f"time), flip+translate TTA "
            f"{100 * gain:+.2f} points (means over {len(new_rows)} and {len(old_rows)} seeds): "
            f"accuracy at least the old and time at most {ACCEPTED_TIME_RATIO}×: **{verdict}**."
        )
    preamble = f"Candidate: the new recipe with `{describe_overrides(candidate)}`.\n\n" if candidate else ""
    return preamble + "\n".join(lines) + "\n\n" + "\n".join(summary)


def ablation_table(records: list[dict[str, Any]]) -> str:
    """One row per recorded run: what it tried, its settings, the epochs and the three accuracies."""
    lines = [
        "| run | preset | seed | overrides | epochs | training (shared machine) | test | flip TTA "
        "| flip+translate TTA |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for record in records:
        overrides = describe_overrides(record["overrides"])
        accuracies = " | ".join(f"{100 * record[name]:.2f} %" for name, _ in ACCURACIES)
        lines.append(
            f"| {record['label']} | `{record['preset']}` | {record['seed']} | {overrides or '—'} | "
            f"{record['epochs']} | {record['training_seconds'] / 60:.1f} min | {accuracies} |"
        )
    return "\n".join(lines)


def docs_body(
    records: list[dict[str, Any]], args: argparse.Namespace, candidate: dict[str, Any], command: str, load_at_start: str
) -> str:
    return (
        "Both recipes of each pair trained and evaluated in one sitting on one host, interleaved run by run "
        "(old and new alternate which goes first), 3 seeds each, nothing else running; every run a fresh process. "
        "Training is the wall time of `cifar.train.train` (whitening initialization, tracing, every epoch, a "
        "checkpoint per epoch, MLflow logging); images/s is the median over the epochs; accuracies are on the "
        "10,000 test images of `../shared/data/cifar-10-python.tar.gz`.\n\n"
        f"Command: `{command}`\n\n"
        f"Machine: {common.machine_description(load_at_start)}; load average at the end: {common.load_average()}."
        f"{' Note: ' + args.note if args.note else ''}\n\n"
        f"{sitting_table(records, args.seeds, candidate)}\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "run":
        run_one(args)
        return
    if args.command == "table":
        print(ablation_table(read_records(Path(args.results))))
        return
    load_at_start = common.load_average()
    candidate = candidate_overrides(args)
    run_sitting(args, candidate)
    records = read_records(results_path(args))
    print(sitting_table(records, args.seeds, candidate))
    if args.write_docs:
        command = common.command_line("time_to_accuracy.py", argv)
        described = describe_overrides(candidate)
        heading = (
            f"{HEADING} ({', '.join(f'`{preset}`' for preset in args.presets)}{'; ' + described if described else ''})"
        )
        common.write_section(heading, docs_body(records, args, candidate, command, load_at_start))
        print(f"wrote {common.DOCS_PATH}")


if __name__ == "__main__":
    main()
