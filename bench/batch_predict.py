"""Batch prediction (`cifar-predict`) against its floor and its alternative, side by side on the real test set.

    .venv/bin/python bench/batch_predict.py --write-docs

The variants, rounds and one-off checks: docs/BENCHMARKS.md, "How each benchmark measures".
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

from harness.servers import ServerHandle, start_model_server  # noqa: E402

SECTION = "## Batch prediction"
MODEL_NAME = "cifar10"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archive", default=str(common.DEFAULT_ARCHIVE))
    parser.add_argument("--workdir", default="/tmp/cifar-bench-predict", help="Bench workdir (its champion reused).")
    parser.add_argument("--preset", default="sprint", help="Preset trained when the workdir has no champion.")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunk", type=int, default=1000, help="Batch of batch prediction and of the plain loop.")
    parser.add_argument("--rest-batch", type=int, default=64)
    parser.add_argument("--rest-images", type=int, default=1280, help="Images sent over REST per round.")
    parser.add_argument("--large", type=int, default=100_000, help="Images of the peak-RSS measurement.")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--note", default=common.SHARED_NOTE)
    return parser.parse_args(argv)


def champion_or_train(args) -> tuple[str, int]:
    """(tracking URI, champion version) of the bench workdir, training the preset first when it has none."""
    from cifar.champion import find_champion

    workdir = Path(args.workdir).resolve()
    tracking_uri = f"sqlite:///{workdir / 'mlflow.db'}"
    champion = find_champion(tracking_uri, MODEL_NAME)
    if champion is None:
        archive = Path(args.archive).expanduser().resolve()
        command = [sys.executable, str(common.REPO_ROOT / "flows" / "pipeline.py"), "--source", str(archive),
                   "--sha256", common.default_sha256(archive), "--workdir", str(workdir), "--preset", args.preset,
                   "--set", "tracking.system_metrics=false"]  # fmt: skip
        print(f"no champion in {workdir}: training one ({' '.join(command[1:])})", flush=True)
        subprocess.run(command, check=True, env={**os.environ, "MLFLOW_TRACKING_URI": tracking_uri})
        champion = find_champion(tracking_uri, MODEL_NAME)
    return tracking_uri, champion.version


def test_images(workdir: Path) -> np.ndarray:
    """The 10,000 test images of the workdir's latest pipeline run, in the archive's order."""
    from cifar.evaluate import load_split
    from cifar.summary import PipelineSummary

    images, _ = load_split(PipelineSummary.read(workdir / "summary.json").data.data_dir, "test")
    return images


def rest_server(model_uri: str, tracking_uri: str, log_path: Path) -> ServerHandle:
    """`mlflow models serve` of `model_uri` on a free port, once /ping answers (this run's log only)."""
    log_path.unlink(missing_ok=True)
    progress_bar = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"]}
    return start_model_server(model_uri, tracking_uri, log_path, timeout=300, **progress_bar)


def rest_classes(url: str, images: np.ndarray, batch: int) -> np.ndarray:
    """The served model's class ids, one JSON request of `batch` images at a time."""
    import urllib.request

    classes = []
    for start in range(0, len(images), batch):
        body = json.dumps({"inputs": images[start : start + batch].tolist()}).encode()
        request = urllib.request.Request(f"{url}/invocations", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            classes += json.loads(response.read())["predictions"]["class_ids"]
    return np.asarray(classes)


LARGE_SCRIPT = """
import json, sys, threading, time
import numpy as np, psutil
from cifar.predict import ScoringModel, predict, resolve_model
path, workdir, tracking_uri, model = sys.argv[1:5]
scoring = ScoringModel(resolve_model(model, tracking_uri), tracking_uri)
scoring.predict(np.zeros((1000, 32, 32, 3), np.uint8))
process = psutil.Process()
baseline = peak = process.memory_info().rss
done = threading.Event()
def sample():
    global peak
    while not done.is_set():
        peak = max(peak, process.memory_info().rss)
        time.sleep(0.01)
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
start = time.perf_counter()
result = predict(path, workdir, model=model, tracking_uri=tracking_uri, scoring_model=scoring)
seconds = time.perf_counter() - start
done.set()
sampler.join()
print(json.dumps({"images": result.images, "baseline": baseline, "peak": peak, "seconds": seconds,
                  "loop_rate": result.images_per_second}))
"""


def measure_large(args, images: np.ndarray, tracking_uri: str, version: int, scratch: Path) -> dict:
    """Peak RSS of a fresh process scoring the test set tiled to `args.large` images (its own .npy)."""
    path = scratch / "large.npy"
    large = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(args.large, 32, 32, 3))
    for start in range(0, args.large, len(images)):
        large[start : start + len(images)] = images[: args.large - start]
    large.flush()
    del large
    command = [sys.executable, "-c", LARGE_SCRIPT, str(path), str(scratch / "large-work"), tracking_uri,
               f"models:/{MODEL_NAME}/{version}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(common.REPO_ROOT)}
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    measured = json.loads(output.strip().splitlines()[-1])
    measured["input_bytes"] = os.path.getsize(path)
    path.unlink()
    return measured


def cpu_details() -> str:
    """What lscpu says beyond the model name (`AMD EPYC` alone does not tell the generation)."""
    try:
        lines = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout
                     .splitlines() if ":" in line)  # fmt: skip
    except OSError:
        return "lscpu not available"
    fields = {key.strip(): value.strip() for key, value in lines.items()}
    details = [f"lscpu: family {fields.get('CPU family', '?')} model {fields.get('Model', '?')}"]
    if fields.get("Hypervisor vendor"):
        details.append(f"under {fields['Hypervisor vendor']}")
    flags = fields.get("Flags", "").split()
    details.append("AVX-512 with bf16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "no AVX-512")
    details.append("AMX" if "amx_tile" in flags else "no AMX")
    return ", ".join(details)


def save_inputs(images: np.ndarray, workdir: Path) -> tuple[Path, Path, Path]:
    """A scratch folder holding the test images as a .npy and their brightened (x1.4) copy."""
    scratch = Path(tempfile.mkdtemp(prefix="batch-predict-", dir=workdir))
    original = scratch / "test.npy"
    np.save(original, images)
    bright = scratch / "test-brightened.npy"
    np.save(bright, np.clip(images.astype(np.float32) * 1.4, 0, 255).astype(np.uint8))
    return scratch, original, bright


def time_rounds(args, images: np.ndarray, rest_images: np.ndarray, plain_loop, batch_prediction, url: str):
    """A warm-up, then `args.rounds` rounds of the three variants in an order rotated each round (a change in
    machine load hits every variant alike): seconds per variant, the batch results, the last classes."""
    plain_loop(), rest_classes(url, rest_images[: args.rest_batch], args.rest_batch)  # Warm-up.
    batch_prediction(-1)
    seconds = {"batch": [], "batch_loop": [], "plain": [], "rest": []}
    results = []
    variants = ["batch", "plain", "rest"]
    for round_index in range(args.rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            start = time.perf_counter()
            if variant == "batch":
                results.append(batch_prediction(round_index))
                seconds["batch_loop"].append(results[-1].images / results[-1].images_per_second)
            elif variant == "plain":
                plain_classes = plain_loop()
            else:
                served = rest_classes(url, rest_images, args.rest_batch)
            seconds[variant].append(time.perf_counter() - start)
        shown = {name: (len(rest_images) if name == "rest" else len(images)) / values[-1]
                 for name, values in seconds.items()}  # fmt: skip
        print(
            f"round {round_index + 1}/{args.rounds}: batch job {shown['batch']:,.0f}, its loop "
            f"{shown['batch_loop']:,.0f}, plain {shown['plain']:,.0f}, REST {shown['rest']:,.0f} images/s "
            f"(load {common.load_average()})",
            flush=True,
        )
    return seconds, results, plain_classes, served


@dataclass
class Outputs:
    """What the scored outputs say, checked once after the rounds."""

    same: int  # Test images whose Parquet `class_id` is the SavedModel's own class.
    rest_same: int  # REST answers equal to the SavedModel's.
    served: np.ndarray  # The REST answers of the last round.
    calm: Any  # The last round's batch prediction (the original test images).
    drifted: Any  # The brightened test images' batch prediction.
    large: dict  # measure_large's peak RSS and timing.


def summary_text(args, images, rest_images, seconds: dict, outputs: Outputs, version: int) -> tuple[str, str]:
    """The table of rates and the paragraph of facts (agreement, drift verdicts, memory)."""
    same, rest_same, served = outputs.same, outputs.rest_same, outputs.served
    calm, drifted, large = outputs.calm, outputs.drifted, outputs.large
    rates = {
        "batch": len(images) / common.median(seconds["batch"]),
        "batch_loop": len(images) / common.median(seconds["batch_loop"]),
        "plain": len(images) / common.median(seconds["plain"]),
        "rest": len(rest_images) / common.median(seconds["rest"]),
    }

    def paired(variant: str) -> float:  # Median over rounds of this round's rate against the floor's.
        count = len(images) if variant != "rest" else len(rest_images)
        return common.median([(count / mine) / (len(images) / floor)
                              for mine, floor in zip(seconds[variant], seconds["plain"])])  # fmt: skip

    mib = 2**20
    table = "\n".join([
        "| variant | images/s (median) | vs the plain SavedModel loop (median of per-round ratios) |",
        "|---|---:|---:|",
        f"| plain `tf.saved_model.load` + `serving_default` loop, batch {args.chunk} (the floor) | "
        f"{rates['plain']:,.0f} | 1.00x |",
        f"| batch prediction, streaming loop (read, score with the pyfunc, monitoring features, Parquet), "
        f"chunk {args.chunk} | {rates['batch_loop']:,.0f} | {paired('batch_loop'):.2f}x |",
        f"| batch prediction, whole job (+ input digest, MLflow run, drift.png, summary.json) | "
        f"{rates['batch']:,.0f} | {paired('batch'):.2f}x |",
        f"| `mlflow models serve` over REST, JSON batches of {args.rest_batch}, one request at a time | "
        f"{rates['rest']:,.0f} | {paired('rest'):.2f}x |",
    ])  # fmt: skip
    facts = (
        f"Batch prediction's streaming loop is {rates['batch_loop'] / rates['rest']:.1f}x REST serving "
        f"(whole job {rates['batch'] / rates['rest']:.1f}x). The Parquet's `class_id` equals the SavedModel's own "
        f"class for {same:,} of {len(images):,} test images; the REST answers for {rest_same:,} of {len(served):,}.\n\n"
        f"Drift on the real test set ({calm.images:,} images, model v{version}): "
        f"original images {calm.verdict()}; brightened x1.4: {drifted.verdict()}.\n\n"
        f"Memory: a fresh process scoring {large['images']:,} images (the test set tiled; "
        f"{large['input_bytes'] / mib:,.0f} MiB of pixels in one .npy) peaked at {large['peak'] / mib:,.0f} MiB RSS, "
        f"{(large['peak'] - large['baseline']) / mib:,.0f} MiB above the process with TensorFlow and the model "
        f"loaded ({large['baseline'] / mib:,.0f} MiB); it took {large['seconds']:.1f} s, "
        f"{large['images'] / large['seconds']:,.0f} images/s for the whole job."
    )
    return table, facts


def docs_body(args, argv, load_at_start: str, version: int, rest_images, table: str, facts: str) -> str:
    """The section of docs/BENCHMARKS.md."""
    return (
        f"`cifar-predict`'s scoring path against the floor it must stay near and the serving path it must beat, on "
        f"the 10,000 real test images, with the champion of a `{args.preset}` run (registry version {version}, "
        f"its SavedModel for the floor, `mlflow models serve` of the same version for REST). {args.rounds} rounds, "
        "the three variants interleaved in an order rotated each round; each batch-prediction round scores "
        "into a fresh directory (the same input is otherwise never scored twice); the model is loaded once for "
        f"the batch path and the floor; REST is timed on {len(rest_images):,} images per round.\n\n"
        f"Command: `{common.command_line('batch_predict.py', argv)}`\n\n"
        f"Machine: {common.machine_description(load_at_start)} ({cpu_details()}). Note: {args.note}.\n\n"
        f"{table}\n\n{facts}\n"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_at_start = common.load_average()
    workdir = Path(args.workdir).resolve()
    tracking_uri, version = champion_or_train(args)

    import mlflow
    import pyarrow.parquet as pq
    import tensorflow as tf

    from cifar.export import INPUT_NAME, SERVING_SIGNATURE
    from cifar.predict import EXPERIMENT, ScoringModel, predict, resolve_model
    from cifar.tracking import ensure_experiment

    model_uri = f"models:/{MODEL_NAME}/{version}"
    export_dir = mlflow.MlflowClient(tracking_uri=tracking_uri).get_model_version(MODEL_NAME, str(version))
    export_dir = export_dir.tags["export_dir"]
    images = test_images(workdir)
    scratch, original, bright = save_inputs(images, workdir)
    ensure_experiment(tracking_uri, workdir, EXPERIMENT)  # Its artifacts under the bench workdir, not a round's.

    scoring = ScoringModel(resolve_model(model_uri, tracking_uri), tracking_uri)
    serve = tf.saved_model.load(export_dir).signatures[SERVING_SIGNATURE]
    server = rest_server(model_uri, tracking_uri, workdir / "mlflow-serve.log")

    def plain_loop() -> np.ndarray:
        return np.concatenate([
            serve(**{INPUT_NAME: tf.constant(images[start : start + args.chunk])})["class_ids"].numpy()
            for start in range(0, len(images), args.chunk)
        ])  # fmt: skip

    def batch_prediction(round_index: int):
        return predict(original, scratch / f"round-{round_index}", model=model_uri, tracking_uri=tracking_uri,
                       chunk_size=args.chunk, scoring_model=scoring)  # fmt: skip

    rest_images = images[: args.rest_images]
    try:
        seconds, results, plain_classes, served = time_rounds(
            args, images, rest_images, plain_loop, batch_prediction, server.url
        )
    finally:
        server.stop()

    # The outputs, once: the Parquet against the SavedModel, REST against it too, the drift verdicts.
    parquet_classes = pq.read_table(results[-1].predictions_path, columns=["class_id"]).column(0).to_numpy()
    outputs = Outputs(
        same=int(np.sum(parquet_classes == plain_classes)),
        rest_same=int(np.sum(served == plain_classes[: len(served)])),
        served=served,
        calm=results[-1],
        drifted=predict(bright, scratch / "brightened", model=model_uri, tracking_uri=tracking_uri,
                        chunk_size=args.chunk, scoring_model=scoring),
        large=measure_large(args, images, tracking_uri, version, scratch),
    )  # fmt: skip
    shutil.rmtree(scratch, ignore_errors=True)
    table, facts = summary_text(args, images, rest_images, seconds, outputs, version)
    print(table + "\n\n" + facts)
    if args.write_docs:
        common.write_section(SECTION, docs_body(args, argv, load_at_start, version, rest_images, table, facts))
        print(f"wrote {common.DOCS_PATH}")


if __name__ == "__main__":
    main()
