"""Training throughput, side by side: stock Keras float32 vs ours (fused batch norm, fused GELU, bf16).

    .venv/bin/python bench/train_throughput.py --write-docs --note "shared with other jobs"

How the steps are timed: docs/BENCHMARKS.md, "How each benchmark measures".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

from cifar.models import build_model, input_size  # noqa: E402
from cifar.performance import cpu_bf16_flags, onednn_enabled  # noqa: E402

SECTION = "## Training throughput"


@dataclass(frozen=True)
class Variant:
    label: str
    precision: str
    fused_batchnorm: bool
    jit_compile: bool = False
    fused_gelu: bool | None = None  # None: same as fused_batchnorm (ours fuses both, stock neither).

    @property
    def gelu_fused(self) -> bool:
        return self.fused_batchnorm if self.fused_gelu is None else self.fused_gelu


STOCK = Variant("stock Keras fp32", "float32", False)
OURS = Variant("ours: fused BN (+ fused GELU) + bf16", "mixed_bfloat16", True)
# The two halves of the change, to show what each contributes (only where the model has batch norm).
FUSED_ONLY = Variant("fused BN, fp32", "float32", True)
BF16_ONLY = Variant("Keras BN, bf16", "mixed_bfloat16", False)
# What "auto" jit avoids on CPU: XLA compiles the convolutions itself instead of calling oneDNN.
OURS_XLA = Variant("ours + XLA (jit_compile)", "mixed_bfloat16", True, jit_compile=True)
# The fast net's GELU: Keras's bfloat16 GELU next to ours (both with fused BN and bf16).
KERAS_GELU = Variant("fused BN + bf16, Keras GELU", "mixed_bfloat16", True, fused_gelu=False)
# The fast net's fused layers without bf16: what bfloat16 adds on this CPU (much with AMX, less without).
FUSED_FP32 = Variant("fused BN + fused GELU, fp32", "float32", True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet20", "tutorial", "fast"])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="Timed training steps per variant.")
    parser.add_argument("--warmup", type=int, default=5, help="Untimed steps per variant before timing.")
    parser.add_argument("--rounds", type=int, default=4, help="Interleaved rounds the timed steps are split into.")
    parser.add_argument("--no-breakdown", action="store_true", help="Only stock vs ours, not the two halves.")
    parser.add_argument("--xla", action="store_true", help="Also time ours with jit_compile=True.")
    parser.add_argument("--write-docs", action="store_true", help=f"Write the table into {common.DOCS_PATH}.")
    parser.add_argument("--note", default="", help="A note on the machine's state (e.g. shared, loaded).")
    parser.add_argument(
        "--section", default=SECTION, help=f"The docs section to (re)write, e.g. one per host (default {SECTION!r})."
    )
    args = parser.parse_args(argv)
    if min(args.batch_size, args.steps, args.rounds) < 1 or args.warmup < 0 or args.steps % args.rounds:
        parser.error("batch size, steps and rounds must be >= 1, warmup >= 0, and rounds must divide steps")
    if not args.section.startswith("## "):
        parser.error(f"--section must be a '## ' heading, got {args.section!r}")
    return args


def variants_for(model_name: str, breakdown: bool, xla: bool) -> list[Variant]:
    has_batch_norm = model_name != "tutorial" and model_name != "tiny"
    variants = [STOCK, FUSED_ONLY, BF16_ONLY, OURS] if breakdown and has_batch_norm else [STOCK, OURS]
    if breakdown and model_name == "fast":
        variants = [STOCK, FUSED_FP32, KERAS_GELU, OURS]
    return variants + [OURS_XLA] if xla else variants


def compiled_model(model_name: str, variant: Variant) -> keras.Model:
    """The model built under the variant's dtype policy (the policy is read when layers are made)."""
    keras.mixed_precision.set_global_policy(variant.precision)
    try:
        keras.utils.set_random_seed(0)
        model = build_model(model_name, fused_batchnorm=variant.fused_batchnorm, fused_gelu=variant.gelu_fused)
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9, nesterov=True),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=variant.jit_compile,
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model


def synthetic_batches(model_name: str, batch_size: int) -> tf.data.Dataset:
    """One fixed uint8 batch, repeated forever: measures the train step, not the input pipeline."""
    size = input_size(model_name)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(batch_size, size, size, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=(batch_size,), dtype=np.int32)
    return tf.data.Dataset.from_tensors((images, labels)).repeat()


class StepClock(keras.callbacks.Callback):
    """Records the wall-clock time at the end of every training step."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())


def fit_steps(model: keras.Model, dataset: tf.data.Dataset, steps: int) -> float:
    """Seconds of `steps` training steps of `model.fit`, timed between step ends.

    One extra step runs first and is not timed, so `fit`'s set-up (iterator, callbacks) is excluded.
    """
    clock = StepClock()
    model.fit(dataset, epochs=1, steps_per_epoch=steps + 1, verbose=0, shuffle=False, callbacks=[clock])
    return clock.times[-1] - clock.times[0]


def measure(model_name: str, args: argparse.Namespace) -> list[tuple[Variant, float]]:
    """Images per second of each variant, timed in interleaved rounds after warm-up."""
    dataset = synthetic_batches(model_name, args.batch_size)
    variants = variants_for(model_name, not args.no_breakdown, args.xla)
    models = [compiled_model(model_name, variant) for variant in variants]
    for model in models:
        if args.warmup:
            fit_steps(model, dataset, args.warmup)
    seconds = [0.0] * len(models)
    steps_per_round = args.steps // args.rounds
    for _ in range(args.rounds):
        for index, model in enumerate(models):
            seconds[index] += fit_steps(model, dataset, steps_per_round)
    return [(variant, args.steps * args.batch_size / elapsed) for variant, elapsed in zip(variants, seconds)]


def training_flops_per_image(model: keras.Model) -> float:
    """Multiply-adds of the convolutions and dense layers, x2 (FLOPs) x3 (forward, input and weight gradients)."""
    multiply_adds = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D):
            height, width = layer.output.shape[1:3]
            multiply_adds += height * width * int(np.prod(layer.kernel.shape))
        elif isinstance(layer, keras.layers.Dense):
            multiply_adds += int(np.prod(layer.kernel.shape))
    return 2.0 * 3.0 * multiply_adds


def matmul_peak(precision: str, size: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a large square matmul in the variant's compute dtype: what oneDNN reaches on this CPU."""
    dtype = tf.bfloat16 if precision == "mixed_bfloat16" else tf.float32
    a = tf.random.normal((size, size), dtype=tf.float32)
    a, b = tf.cast(a, dtype), tf.cast(tf.transpose(a), dtype)
    product = tf.function(lambda x, y: tf.matmul(x, y))
    product(a, b).numpy()  # Warm-up: oneDNN's primitive is created here.
    start = time.perf_counter()
    for _ in range(repeats):
        result = product(a, b)
    result.numpy()
    return 2.0 * size**3 * repeats / (time.perf_counter() - start)


def machine_description(load_at_start: str) -> str:
    """The shared machine line plus whether the CPU has bfloat16 math and oneDNN is on."""
    return (
        f"{common.machine_description(load_at_start)}; bfloat16 instructions: "
        f"{', '.join(cpu_bf16_flags()) or 'none'}, oneDNN: {'on' if onednn_enabled() else 'off'}"
    )


def markdown_table(
    results: dict[str, list[tuple[Variant, float]]], batch_size: int, flops: dict[str, float], peaks: dict[str, float]
) -> str:
    """One row per model and variant; GFLOP/s counts conv and dense math only, against a large matmul's rate."""
    lines = [
        f"| model | variant | images/s (batch {batch_size}) | vs stock fp32 | GFLOP/s | share of the matmul peak |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model_name, rows in results.items():
        stock = rows[0][1]
        for variant, images_per_second in rows:
            rate = images_per_second * flops[model_name]
            lines.append(
                f"| {model_name} | {variant.label} | {images_per_second:,.0f} | {images_per_second / stock:.2f}x "
                f"| {rate / 1e9:,.0f} | {100 * rate / peaks[variant.precision]:.0f} % |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_at_start = common.load_average()
    results = {model_name: measure(model_name, args) for model_name in args.models}
    flops = {name: training_flops_per_image(compiled_model(name, STOCK)) for name in args.models}
    peaks = {precision: matmul_peak(precision) for precision in ("float32", "mixed_bfloat16")}
    table = markdown_table(results, args.batch_size, flops, peaks)
    peak_line = ", ".join(f"{precision} {rate / 1e9:,.0f} GFLOP/s" for precision, rate in peaks.items())
    print(table)
    if args.write_docs:
        command = common.command_line("train_throughput.py", argv)
        note = f"\n\nLoad average (1/5/15 min) at the end of the run: {common.load_average()}."
        note += f" Note: {args.note}" if args.note else ""
        body = (
            "Images/s of `model.fit` training steps (SGD + momentum, sparse cross-entropy) on one fixed\n"
            f"uint8 batch repeated in memory, {args.warmup} warm-up steps excluded, {args.steps} timed steps per\n"
            f'variant interleaved in {args.rounds} rounds so load changes hit every variant alike. "Ours" is\n'
            "`fused_batchnorm=True` (cifar.layers.FusedBatchNormalization) and, in the fast net,\n"
            "`fused_gelu=True` (cifar.layers.Gelu: XLA-fused GELU kernels) with the `mixed_bfloat16` policy;\n"
            '"stock" is Keras\'s BatchNormalization and GELU in float32. The tutorial CNN has no batch norm, so\n'
            'its gain is bfloat16 alone. XLA is off (for the whole step) except in the "+ XLA" rows.\n'
            "GFLOP/s: the convolutions' and dense layers' multiply-adds x 2 x 3 (forward, input and weight\n"
            "gradients) per image; the peak is a 2,048 x 2,048 matmul's rate in the same precision on this\n"
            f"machine ({peak_line}).\n\n"
            f"Command: `{command}`\n\n"
            f"Machine: {machine_description(load_at_start)}{note}\n\n"
            f"{table}\n"
        )
        common.write_section(args.section, body)
        print(f"wrote {common.DOCS_PATH}")


if __name__ == "__main__":
    main()
