"""One training in 1 against N processes on this host (MultiWorkerMirroredStrategy on 127.0.0.1): examples/s.

    .venv/bin/python bench/multiworker.py --workers 1 2 --write-docs --note "shared with other jobs"

Each count trains the same run (`cifar.train.train`, global batch fixed) in N fresh processes on the same
prepared shards of the real archive, with the cluster a rendezvous hands out (TF_CONFIG on 127.0.0.1);
reported: the chief's `examples_per_second` (training steps only) of every epoch after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

from harness.ports import HOST, free_port  # noqa: E402

SECTION = "## Multi-worker training on one host"
READING = """Two workers on one 2-core host are no way to train faster: each process computes half of every global
batch on the same two cores, both exchange the gradients over gRPC, and each starts up, builds its input
pipeline and validates on its own, so the same run costs more CPU (the last column). The examples/s do not
show that cost: on a machine shared with other jobs, two processes win a larger share of its cores than
one, which is all a ratio above 1.00x measures here. On an idle 2-core host a run needs at least its
CPU seconds / 2 of wall time. The network each model needs to gain from more machines: "Multi-worker
training: the all-reduce per step and the network it needs" in docs/BENCHMARKS.md."""


def train_one(data_dir: str, workdir: str, overrides: str) -> None:
    """A worker process: trains with TF_CONFIG from the environment (the chief writes the run)."""
    from cifar.config import make_config
    from cifar.train import train

    train(make_config("default", json.loads(overrides)), data_dir, workdir)


def measure(workers: int, data_dir: str, overrides: dict) -> tuple[list[float], float]:
    """Trains in `workers` processes: the chief's examples/s of every epoch after the first, and the CPU seconds
    all the processes used (start-up and validation included: every worker validates too)."""
    workdir = tempfile.mkdtemp(prefix=f"cifar-bench-workers{workers}-")
    addresses = [f"{HOST}:{free_port()}" for _ in range(workers)]
    before = common.children_cpu_seconds()
    processes = []
    for index in range(workers):
        environment = dict(os.environ)
        if workers > 1:
            cluster = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
            environment["TF_CONFIG"] = json.dumps(cluster)
        command = [sys.executable, __file__, "--train-one", data_dir, workdir, json.dumps(overrides)]
        processes.append(subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL))
    if any(process.wait() != 0 for process in processes):
        raise SystemExit(f"a training process of the {workers}-worker run failed")
    cpu = common.children_cpu_seconds() - before
    history = json.loads(next(Path(workdir, "runs").glob("*/history.json")).read_text())
    return history["examples_per_second"][1:], cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-one", nargs=3, metavar=("DATA_DIR", "WORKDIR", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--batch-size", type=int, default=128, help="the global batch, split over the workers")
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each running every worker count in turn")
    parser.add_argument("--archive", type=Path, default=common.DEFAULT_ARCHIVE)
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--note", default=common.SHARED_NOTE)
    args = parser.parse_args(argv)
    if args.train_one:
        train_one(*args.train_one)
        return
    load = common.load_average()
    data_dir = str(common.prepare_bench_data(args.archive))
    overrides = {
        "train": {
            "model": args.model,
            "batch_size": args.batch_size,
            "steps_per_epoch": args.steps,
            "epochs": args.epochs,
            "precision": "float32",
            "precise_bn_images": 0,
        },
        "tracking": {"system_metrics": False},
    }
    speeds: dict[int, list[float]] = {workers: [] for workers in args.workers}
    cpu: dict[int, list[float]] = {workers: [] for workers in args.workers}
    for round_number in range(args.rounds):  # Interleaved: a change in the machine's load hits every count alike.
        for workers in args.workers:
            measured, seconds = measure(workers, data_dir, overrides)
            speeds[workers] += measured
            cpu[workers].append(seconds)
            print(f"round {round_number + 1}, {workers} worker(s): {measured} examples/s, {seconds:.0f} CPU s; "
                  f"load {common.load_average()}")  # fmt: skip
    rows = [(workers, common.median(speeds[workers]), common.median(cpu[workers])) for workers in args.workers]
    base = rows[0][1]
    table = "\n".join(
        f"| {workers} | {speed:,.0f} | {speed / base:.2f}x | {seconds:,.0f} |" for workers, speed, seconds in rows
    )
    body = (
        f"`{common.command_line('multiworker.py', argv)}` on {common.machine_description(load)}; {args.note}.\n\n"
        f"{args.model}, global batch {args.batch_size}, {args.steps} steps per epoch, float32, {args.rounds} "
        f"interleaved rounds; the median of the chief's examples/s over epochs 2-{args.epochs} of every round.\n\n"
        "| workers | examples/s | against 1 | CPU seconds of all its processes |\n|---|---|---|---|\n"
        + table
        + "\n\n"
        + READING
    )
    print(body)
    if args.write_docs:
        common.write_section(SECTION, body)


if __name__ == "__main__":
    main()
