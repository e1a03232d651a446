"""Where one training step of a model spends its time: TensorFlow's profiler, op types by self time.

    .venv/bin/python bench/profile_step.py --model resnet56 --precision mixed_bfloat16 --write-docs

Traces a few `train_on_batch` steps (after warm-up) of the model as `cifar.train` builds it on one
fixed batch, and tables each op type's share of the traced time ("IDLE": no op ran on a thread).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import train_throughput  # noqa: E402

SECTION = "## Profile of one training step"


def profile(model_name: str, precision: str, batch_size: int, steps: int) -> tuple[list[tuple[str, float]], float]:
    """(op type, share of the traced time) by self time, largest first, and the untraced images/s."""
    import tensorflow as tf

    from cifar import compat

    variant = train_throughput.Variant(precision, precision, True)
    model = train_throughput.compiled_model(model_name, variant)
    images, labels = next(iter(train_throughput.synthetic_batches(model_name, batch_size)))
    for _ in range(5):
        model.train_on_batch(images, labels)
    start = time.perf_counter()
    for _ in range(steps):
        model.train_on_batch(images, labels)
    images_per_second = steps * batch_size / (time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for _ in range(steps):
            model.train_on_batch(images, labels)
        tf.profiler.experimental.stop()
        trace = next(Path(logdir).rglob("*.xplane.pb"))
        rows = compat.profiled_op_times(str(trace))
    by_type: collections.Counter[str] = collections.Counter()
    for row in rows:
        by_type[row["type"].removeprefix("_MklNative").removeprefix("_Mkl")] += row["total_self_time"]
    total = sum(by_type.values())
    return [(name, time_ / total) for name, time_ in by_type.most_common()], images_per_second


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet56")
    parser.add_argument("--precision", nargs="+", default=["mixed_bfloat16", "float32"])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    load = common.load_average()
    shares, speeds, peaks = {}, {}, {}
    for precision in args.precision:
        shares[precision], speeds[precision] = profile(args.model, precision, args.batch_size, args.steps)
        peaks[precision] = train_throughput.matmul_peak(precision)
    flops = train_throughput.training_flops_per_image(
        train_throughput.compiled_model(args.model, train_throughput.STOCK)
    )
    names = [name for name, share in shares[args.precision[0]] if share >= 0.005]
    header = " | ".join(f"{precision} ({speeds[precision]:.0f} images/s)" for precision in args.precision)
    lines = [f"| op type | {header} |", "|---|" + "---:|" * len(args.precision)]
    for name in names:
        cells = " | ".join(f"{100 * dict(shares[precision]).get(name, 0.0):.1f} %" for precision in args.precision)
        lines.append(f"| {name} | {cells} |")
    table = "\n".join(lines)
    peak_lines = [
        f"- {precision}: {speeds[precision]:.0f} images/s x {flops / 1e9:.3f} GFLOP = "
        f"{speeds[precision] * flops / 1e9:.0f} GFLOP/s, {100 * speeds[precision] * flops / peaks[precision]:.0f} % of "
        f"a {2048}x{2048} matmul's {peaks[precision] / 1e9:.0f} GFLOP/s on the same cores"
        for precision in args.precision
    ]
    print(table + "\n\n" + "\n".join(peak_lines))
    if args.write_docs:
        body = (
            f"`{common.command_line('profile_step.py', argv)}`; {common.machine_description(load)}.\n\n"
            f"Share of the traced self time of {args.steps} steps of {args.model} at batch {args.batch_size} "
            "(fused batch norm), by op type (oneDNN's `_MklNative` prefix dropped); op types under 0.5 % "
            f"left out.\n\n{table}\n\nShare of the cores' practical peak (training FLOPs per image: 3x the "
            "forward pass's convolutions and dense layer, 2 per multiply-add):\n\n" + "\n".join(peak_lines)
        )
        common.write_section(f"{SECTION} ({args.model})", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
