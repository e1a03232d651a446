"""Freed memory reused: a training and an evaluation after TensorFlow's generator malloc patch, kept and undone.

    .venv/bin/python bench/freed_memory.py --write-docs

TF 2.21's first GeneratorDataset kernel (every strategy's MultiDeviceIterator makes one) fixes glibc's mmap
threshold at 128 KiB for the whole process; `cifar.distribute.create_strategy` undoes it
(`cifar.compat.undo_generator_malloc_patch`). Each variant is a fresh interpreter that makes the strategy and
then works as the smoke preset's training and evaluation do (the tutorial CNN: 120 steps at batch 128 on 24x24
crops, then 10,000 images scored 125 at a time); `patched` makes the strategy with the undo replaced by a no-op:
  - patched: the process as it was (every block of 128 KiB or more mapped afresh and unmapped when freed);
  - ours:    the strategy as shipped (glibc keeps freed blocks up to 32 MiB for the next step).
CPU seconds are user + system time of the child (getrusage); page faults its minor faults.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

SECTION = "## Freed memory reused"
WORKLOAD = """
import json, resource, sys
import numpy as np
import cifar._keras_imports
import tensorflow as tf
from cifar import compat, distribute
from cifar.config import TrainConfig
from cifar.models import build_model, input_size

if sys.argv[1] == "patched":
    compat.undo_generator_malloc_patch = lambda: False
strategy = distribute.create_strategy(distribute.plan_devices(TrainConfig(model="tutorial")))
size = input_size("tutorial")
rng = np.random.default_rng(0)
images = rng.integers(0, 256, size=(1280, size, size, 3), dtype=np.uint8)
labels = rng.integers(0, 10, size=(1280,), dtype=np.int32)
with strategy.scope():
    model = build_model("tutorial")
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
before = resource.getrusage(resource.RUSAGE_SELF)
model.fit(tf.data.Dataset.from_tensor_slices((images, labels)).batch(128).repeat(), steps_per_epoch=120, verbose=0)
model.predict(np.resize(images, (10_000, size, size, 3)), batch_size=125, verbose=0)
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"user": after.ru_utime - before.ru_utime, "system": after.ru_stime - before.ru_stime,
                  "faults": after.ru_minflt - before.ru_minflt, "max_rss_mib": after.ru_maxrss / 1024}))
"""
VARIANTS = ("patched", "ours")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="Fresh processes per variant (interleaved).")
    parser.add_argument("--write-docs", action="store_true", help=f"Replace docs/BENCHMARKS.md's {SECTION!r}.")
    parser.add_argument("--note", default=None, help="A note on the machine's state, printed with the figures.")
    return parser.parse_args(argv)


def measured(variant: str) -> dict[str, float]:
    """The workload's CPU seconds (user, system), minor page faults and peak RSS in a fresh interpreter."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([sys.executable, "-c", WORKLOAD, variant], cwd=common.REPO_ROOT, env=env, check=True,
                            capture_output=True, text=True)  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(repeats: int) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    for repeat in range(repeats):
        order = VARIANTS if repeat % 2 == 0 else tuple(reversed(VARIANTS))  # Drift hits both alike.
        for variant in order:
            results[variant].append(measured(variant))
            run = results[variant][-1]
            print(f"round {repeat + 1}/{repeats} {variant}: {run['user'] + run['system']:.2f} CPU-s "
                  f"({run['system']:.2f} system), {run['faults']:,} page faults")  # fmt: skip
    return results


def table(results: dict[str, list[dict[str, float]]]) -> str:
    def median(variant: str, key: str) -> float:
        return common.median([run[key] if key != "cpu" else run["user"] + run["system"] for run in results[variant]])

    rows = ["| variant | median CPU s | of it system | minor page faults | peak RSS MiB | CPU vs patched |",
            "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for variant in VARIANTS:
        cpu, system, faults = median(variant, "cpu"), median(variant, "system"), median(variant, "faults")
        ratio = cpu / median("patched", "cpu")
        rows.append(f"| {variant} | {cpu:.2f} | {system:.2f} | {faults:,.0f} | {median(variant, 'max_rss_mib'):,.0f} | "
                    f"{ratio:.2f}x |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_at_start = common.load_average()
    text = table(measure(args.repeats))
    print(text)
    if args.write_docs:
        description = (
            "TensorFlow 2.21's first GeneratorDataset kernel in a process (every `tf.distribute` strategy's "
            "MultiDeviceIterator makes one) calls `mallopt(M_MMAP_THRESHOLD, 128 KiB)`, against memory growth with "
            "Python generators (tensorflow#65675); that also ends glibc's dynamic threshold, so from then on every "
            "activation, gradient and batch of 128 KiB or more is mapped afresh, zeroed by the kernel page by "
            "page, and unmapped when freed. `cifar.distribute.create_strategy` makes that kernel at once and sets "
            "glibc's own ceiling over it (`cifar.compat.undo_generator_malloc_patch`: blocks up to 32 MiB from the "
            "heap, trimmed past 64 MiB free). Each variant is a fresh interpreter making the strategy, then the "
            "smoke preset's training and evaluation shapes (the tutorial CNN, 120 steps at batch 128, 10,000 "
            f"images scored 125 at a time); `patched` replaces the undo with a no-op. {args.repeats} of each, "
            "interleaved; the figures cover the workload only (getrusage before and after it), not start-up."
        )
        common.write_measured_section(SECTION, description, "freed_memory.py", argv, load_at_start, args.note, text)


if __name__ == "__main__":
    main()
