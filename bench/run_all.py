"""Runs every benchmark in sequence (never two at once); each rewrites its own section of docs/BENCHMARKS.md.

    .venv/bin/python bench/run_all.py                       # all, with --write-docs (`make bench`)
    .venv/bin/python bench/run_all.py --only serving orchestration
    .venv/bin/python bench/run_all.py --no-docs             # print the tables only

A failing script is reported and the others still run; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import common  # noqa: E402

SCRIPTS = (
    "convert",
    "data_gate",
    "train_throughput",
    "input_pipeline",
    "serving",
    "orchestration",
    "startup",
    "setup_install",
    "search",
    "model_card",
)
POSITIONAL_ARCHIVE = ("convert", "data_gate", "model_card")  # Take the archive as their first argument.
ARCHIVE_SCRIPTS = ("input_pipeline", "serving", "orchestration", "search")  # Take --archive.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=SCRIPTS, help="Run only these scripts (in the usual order).")
    parser.add_argument("--skip", nargs="+", choices=SCRIPTS, default=[], help="Scripts not to run.")
    parser.add_argument("--no-docs", action="store_true", help="Do not pass --write-docs.")
    parser.add_argument("--note", default=None, help="Machine note passed to every script (--note).")
    parser.add_argument("--archive", default=str(common.DEFAULT_ARCHIVE), help="The real CIFAR-10 archive.")
    return parser.parse_args(argv)


def command_for(name: str, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, str(BENCH_DIR / f"{name}.py")]
    if name in POSITIONAL_ARCHIVE:
        command.append(args.archive)
    elif name in ARCHIVE_SCRIPTS and Path(args.archive) != common.DEFAULT_ARCHIVE:
        command += ["--archive", args.archive]
    if name == "serving":
        command.append("--http")  # `mlflow models serve` too: about 15 s more.
    if not args.no_docs:
        command.append("--write-docs")
    if args.note is not None:
        command += ["--note", args.note]
    return command


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selected = [name for name in SCRIPTS if (args.only is None or name in args.only) and name not in args.skip]
    outcomes: list[tuple[str, int, float]] = []
    for name in selected:
        command = command_for(name, args)
        print(f"=== {name}: {' '.join(command[1:])} (load average {common.load_average()})", flush=True)
        start = time.perf_counter()
        returncode = subprocess.run(command, cwd=common.REPO_ROOT).returncode
        outcomes.append((name, returncode, time.perf_counter() - start))
    print("\n=== summary")
    for name, returncode, seconds in outcomes:
        print(f"{name:18s} {'ok' if returncode == 0 else f'FAILED ({returncode})':12s} {seconds:7.1f} s")
    return 0 if all(returncode == 0 for _, returncode, _ in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
