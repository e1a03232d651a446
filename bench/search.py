"""The hyperparameter search on this machine: trials in parallel, and what pruning saves.

    .venv/bin/python bench/search.py                        # print the table
    .venv/bin/python bench/search.py --write-docs           # and replace its section of docs/BENCHMARKS.md

The three runs and what is timed: docs/BENCHMARKS.md, "How each benchmark measures".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import common  # noqa: E402

HEADING = "## Hyperparameter search"
TRIALS = 8
SPACE = {
    "name": "bench",
    "params": {
        "model": {"type": "categorical", "choices": ["tiny", "tutorial"]},
        "learning_rate": {"type": "float", "low": 0.001, "high": 0.3, "log": True},
        "weight_decay": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
    },
    "pruner": {"kind": "median", "startup_trials": 2, "min_epochs": 1},
}
VARIANTS = (  # (name, --parallel, pruner)
    ("parallel 1, median pruner", 1, "median"),
    ("parallel 2, median pruner", 2, "median"),
    ("parallel 2, no pruning", 2, "none"),
)
SEQUENTIAL_NOTE = (
    "the machine's 2 cores may have been shared with other jobs, and the variants ran one after another "
    "(not interleaved), so the ratios are indicative"
)
OVERRIDES = ["train.epochs=3", "train.steps_per_epoch=30", "tracking.system_metrics=false"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archive", default=str(common.DEFAULT_ARCHIVE), help="The real CIFAR-10 archive.")
    parser.add_argument("--write-docs", action="store_true", help="Replace this section of docs/BENCHMARKS.md.")
    parser.add_argument("--note", default=SEQUENTIAL_NOTE, help="A note on the machine's load.")
    return parser.parse_args(argv)


def run_search(name: str, parallel: int, pruner: str, root: Path, data_dir: Path, archive: Path, sha256: str) -> dict:
    """One search in its own workdir (shards hard-linked from `data_dir`); its timings and epochs."""
    workdir = root / name.replace(" ", "-").replace(",", "")
    shutil.copytree(
        data_dir, workdir / "data" / data_dir.name, copy_function=lambda src, dst: Path(dst).hardlink_to(src)
    )
    space_path = workdir / "space.json"
    space_path.write_text(json.dumps({**SPACE, "pruner": {**SPACE["pruner"], "kind": pruner}}))
    command = [
        sys.executable, "flows/search.py", "--source", str(archive), "--sha256", sha256, "--workdir", str(workdir),
        "--preset", "smoke", "--trials", str(TRIALS), "--parallel", str(parallel), "--space", str(space_path),
        "--until", "train", *[item for override in OVERRIDES for item in ("--set", override)],
    ]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(root / "prefect-home"), "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    print(f"--- {name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=common.REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    summary = json.loads((workdir / "search-summary.json").read_text())
    trials = summary["trials"]
    starts = [datetime.fromisoformat(row["started"]) for row in trials]
    ends = [datetime.fromisoformat(row["finished"]) for row in trials]
    return {
        "name": name,
        "wall": wall,
        "search": (max(ends) - min(starts)).total_seconds(),
        "epochs": sum(row["epochs_reported"] for row in trials),
        "pruned": summary["counts"]["PRUNED"],
        "failed": summary["counts"]["FAIL"],
        "best": summary["best"]["value"] if summary["best"] else None,
        "params": [row["params"] for row in trials],
    }


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        "| variant | wall time (s) | vs parallel 1 | search time (s) | vs parallel 1 | epochs trained | pruned "
        "| failed | best val_accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        best = "-" if row["best"] is None else f"{row['best']:.4f}"
        lines.append(
            f"| {row['name']} | {row['wall']:.0f} | {row['wall'] / base['wall']:.2f}x | {row['search']:.0f} | "
            f"{row['search'] / base['search']:.2f}x | {row['epochs']} of {TRIALS * 3} | {row['pruned']} | "
            f"{row['failed']} | {best} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = common.load_average()
    archive = Path(args.archive).expanduser().resolve()
    sha256 = common.default_sha256(archive)
    if sha256 is None:
        raise SystemExit(f"no known SHA-256 for {archive}: put it in {archive.name}.sha256 beside it")
    data_dir = common.prepare_bench_data(archive, sha256=sha256)
    root = Path(tempfile.mkdtemp(prefix="cifar-bench-search-"))
    try:
        rows = [
            run_search(name, parallel, pruner, root, data_dir, archive, sha256) for name, parallel, pruner in VARIANTS
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    same = all(row["params"] == rows[0]["params"] for row in rows)
    result = table(rows)
    print(result)
    body = f"""Wall time of the same {TRIALS}-trial search (`python flows/search.py`, no server: a temporary
local pool with `--parallel` process workers) at `--parallel 1` and `--parallel 2`, and the epochs it
trains with and without the median pruner (2 startup trials, pruning from epoch 1). Smoke-sized, on
the real archive: the `bench` space of `bench/search.py` (model tiny|tutorial, learning rate
1e-3..0.3 log, weight decay 1e-5..1e-3 log), 3 epochs of 30 steps at batch 128, `--until train`.
The three runs tried {"the same" if same else "different"} {TRIALS} settings (same seed). "Search time"
runs from the first trial's start to the last trial's end; wall time adds the temporary server and
workers (about 20-30 s) and the study's plots.

Command: `{common.command_line("search.py", argv)}`

Machine: {common.machine_description(load_at_start, tensorflow=False)}

Load average (1/5/15 min) at the end of the run: {common.load_average()}. Note: {args.note}

{result}

On 2 cores two trials at once share the cores, so a parallel trial trains more slowly than a lone one;
the gain comes from overlapping each trial's fixed costs (process start, TensorFlow import, data
loading, MLflow) with another trial's training. On N machines (or GPUs) each trial has its own device,
and the search time divides by about N.
"""
    if args.write_docs:
        common.write_section(HEADING, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
