"""Serving speed of the exported SavedModel: throughput at batch 256 and latency at batch 1.

    .venv/bin/python bench/serving.py --write-docs

The model, the variants and the measures: docs/BENCHMARKS.md, "How each benchmark measures".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from load import Load, run_hey  # noqa: E402

from cifar.config import make_config  # noqa: E402
from harness.servers import start_endpoint, start_model_server  # noqa: E402

SECTION = "## Serving"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archive", default=str(common.DEFAULT_ARCHIVE))
    parser.add_argument("--workdir", default=str(common.DEFAULT_BENCH_WORKDIR), help="Bench workdir (reused).")
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--train-steps", type=int, default=20, help="steps_per_epoch of the 1-epoch training.")
    parser.add_argument("--batch-size", type=int, default=256, help="Batch of the throughput measurement.")
    parser.add_argument("--batch-calls", type=int, default=10, help="Timed batch calls per variant per round.")
    parser.add_argument("--single-calls", type=int, default=60, help="Timed batch-1 calls per variant per round.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--http", action="store_true", help="Also time `mlflow models serve` over HTTP.")
    parser.add_argument("--http-calls", type=int, default=40, help="Timed batch-1 HTTP requests.")
    parser.add_argument("--http-batch", type=int, default=32, help="Batch of the HTTP throughput requests.")
    parser.add_argument(
        "--endpoint",
        action="store_true",
        help="Also load the endpoint (flows/serve.py) and `mlflow models serve` with concurrent clients.",
    )
    parser.add_argument("--clients", default="1,8,64", help="Concurrent clients of the endpoint's PNG rows.")
    parser.add_argument(
        "--ray-python", help="An interpreter with ray[serve]: adds Ray Serve rows (bench/ray_endpoint.py)."
    )
    parser.add_argument("--load-seconds", type=float, default=15.0, help="Duration of each load row (s).")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--note", default=common.SHARED_NOTE)
    return parser.parse_args(argv)


def export_once(args, data_dir: Path):
    """Train (or reuse) -> evaluate -> export_model; returns (config, training, evaluation, export, seconds)."""
    from cifar.evaluate import evaluate
    from cifar.export import export_model
    from cifar.train import train

    archive = str(Path(args.archive).expanduser().resolve())
    config = make_config(
        "default",
        {
            "data": {"source": archive, "sha256": common.default_sha256(Path(archive))},
            "train": {"model": args.model, "epochs": 1, "steps_per_epoch": args.train_steps, "keep_checkpoints": 1},
            "evaluate": {"flip_tta": False},
            "tracking": {"system_metrics": False},
        },
    )
    workdir = Path(args.workdir)
    training = train(config, data_dir, workdir)
    evaluation = evaluate(
        config,
        data_dir,
        training.checkpoint_dir,
        workdir,
        mlflow_run_id=training.mlflow_run_id,
        tracking_uri=training.tracking_uri,
    )
    start = time.perf_counter()
    export = export_model(
        config,
        data_dir,
        training.checkpoint_dir,
        workdir,
        evaluation,
        refresh=True,
        mlflow_run_id=training.mlflow_run_id,
        tracking_uri=training.tracking_uri,
    )
    return config, training, evaluation, export, time.perf_counter() - start


def make_variants(export_dir: str, checkpoint_dir: str, epoch: int):
    """name -> (callable on a uint8 batch, callable on a PNG batch or None)."""
    from cifar.checkpoints import load_eval_model, load_index
    from cifar.export import BYTES_INPUT_NAME, BYTES_SIGNATURE, INPUT_NAME, SERVING_SIGNATURE

    loaded = tf.saved_model.load(export_dir)
    serve = loaded.signatures[SERVING_SIGNATURE]
    serve_bytes = loaded.signatures[BYTES_SIGNATURE]
    model = load_eval_model(checkpoint_dir, load_index(Path(checkpoint_dir)).entry(epoch))

    @tf.function(input_signature=[tf.TensorSpec([None, 32, 32, 3], tf.uint8)])
    def keras_call(images):
        return tf.cast(model(tf.cast(images, tf.float32), training=False), tf.float32)

    def numpy_out(outputs):
        return {key: value.numpy() for key, value in outputs.items()} if isinstance(outputs, dict) else outputs.numpy()

    return {
        "serving_default": lambda images, _png: numpy_out(serve(**{INPUT_NAME: tf.constant(images)})),
        "serving_bytes": lambda _images, png: numpy_out(serve_bytes(**{BYTES_INPUT_NAME: tf.constant(png)})),
        "keras": lambda images, _png: numpy_out(keras_call(tf.constant(images))),
    }


def timed(call, images, png) -> float:
    start = time.perf_counter()
    call(images, png)
    return time.perf_counter() - start


def measure_in_process(variants, images: np.ndarray, png: np.ndarray, args):
    """Per-call seconds; every timed call of one variant is followed by one of each other variant, in an
    order rotated call by call, so a change in machine load hits every variant alike."""
    batch = (images[: args.batch_size], png[: args.batch_size])
    names = list(variants)
    batch_seconds = {name: [] for name in variants}
    single_seconds = {name: [] for name in variants}
    for call in variants.values():  # Warm-up: tracing, oneDNN primitives for both shapes.
        for _ in range(3):
            call(*batch)
        for index in range(10):
            call(images[index : index + 1], png[index : index + 1])
    single_index = 0
    for round_index in range(args.rounds):
        for call_index in range(args.batch_calls):
            shift = call_index % len(names)
            for name in names[shift:] + names[:shift]:
                batch_seconds[name].append(timed(variants[name], *batch))
        for call_index in range(args.single_calls):
            position = single_index % len(images)
            single_index += 1
            shift = call_index % len(names)
            for name in names[shift:] + names[:shift]:
                single_seconds[name].append(
                    timed(variants[name], images[position : position + 1], png[position : position + 1])
                )
        for name in names:
            print(
                f"round {round_index + 1}/{args.rounds} {name}: "
                f"{args.batch_size / common.median(batch_seconds[name][-args.batch_calls :]):,.0f} images/s, "
                f"p50 {1000 * common.median(single_seconds[name][-args.single_calls :]):.2f} ms",
                flush=True,
            )
    return batch_seconds, single_seconds


# Optional: mlflow models serve over HTTP.


def post(url: str, payload: bytes) -> float:
    request = urllib.request.Request(url, data=payload, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - start


def measure_http(config, export, training, images: np.ndarray, args, data_dir) -> dict:
    """Registers the export (pyfunc), serves it with `mlflow models serve`, times JSON requests."""
    promotion = register(config, export, training, images, data_dir)
    log_path = Path(args.workdir) / "mlflow-serve.log"
    log_path.unlink(missing_ok=True)  # This run's log only.
    start = time.perf_counter()
    server = start_model_server(promotion.model_uri, training.tracking_uri, log_path)
    try:
        startup = time.perf_counter() - start
        url = server.url

        def payload(batch: np.ndarray) -> bytes:
            return json.dumps({"inputs": batch.tolist()}).encode()

        single = [payload(images[index : index + 1]) for index in range(args.http_calls)]
        batch = payload(images[: args.http_batch])
        for body in single[:5]:
            post(f"{url}/invocations", body)
        post(f"{url}/invocations", batch)
        single_seconds = [post(f"{url}/invocations", body) for body in single]
        batch_seconds = [post(f"{url}/invocations", batch) for _ in range(5)]
        return {
            "startup": startup,
            "single": single_seconds,
            "batch": batch_seconds,
            "payload_kb": len(batch) / 1024,
            "model_uri": promotion.model_uri,
        }
    finally:
        server.stop()


def measure_ray(args, export_dir: str, bodies: Path, clients: list[int], load) -> list[tuple[int, Load]]:
    """bench/ray_endpoint.py under `--ray-python`, loaded like ours; Ray's processes stopped after."""
    import subprocess
    import urllib.error

    from harness.ports import free_port
    from harness.processes import spawn

    port = free_port()
    url = f"http://127.0.0.1:{port}/predict"
    log_path = Path(args.workdir) / "ray-endpoint.log"
    command = [args.ray_python, str(Path(__file__).with_name("ray_endpoint.py")), export_dir, str(port)]
    handle = spawn(command, {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, log_path)
    try:
        deadline = time.monotonic() + 300
        while True:
            request = urllib.request.Request(
                url, data=(bodies / "one.png").read_bytes(), headers={"Content-Type": "image/png"}
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline or not handle.alive():
                raise RuntimeError(f"Ray Serve did not answer:\n{handle.logs()[-3000:]}")
            time.sleep(1)
        return [(count, load(url, "one.png", "image/png", count)) for count in clients]
    finally:
        handle.stop()
        ray = Path(args.ray_python).with_name("ray")
        subprocess.run([str(ray), "stop", "--force"], capture_output=True, timeout=120, check=False)


def register(config, export, training, images, data_dir):
    from cifar.registry import register_and_promote

    return register_and_promote(
        config,
        export,
        data_dir,
        mlflow_run_id=training.mlflow_run_id,
        tracking_uri=training.tracking_uri,
        input_example=images[:1],
    )


def measure_endpoints(config, export, training, images: np.ndarray, args, data_dir) -> list[tuple[str, int, Load]]:
    """(row label, images per request, load) for the endpoint and for `mlflow models serve`, one after the other,
    each alone on the machine with its load generator."""
    promotion = register(config, export, training, images, data_dir)
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=training.tracking_uri)
    client.set_registered_model_alias(config.export.model_name, "champion", str(promotion.registered_model_version))
    bodies = Path(args.workdir) / "bodies"
    bodies.mkdir(parents=True, exist_ok=True)
    (bodies / "one.png").write_bytes(tf.io.encode_png(images[0]).numpy())
    (bodies / "batch32.json").write_text(json.dumps({"inputs": images[:32].tolist()}))
    (bodies / "one.json").write_text(json.dumps({"inputs": images[:1].tolist()}))
    clients = [int(count) for count in args.clients.split(",")]
    rows = []

    def load(url: str, body: str, kind: str, count: int) -> Load:
        run_hey(url, str(bodies / body), kind, count, 3)  # Warm-up: tracing for this batch shape, connections.
        result = run_hey(url, str(bodies / body), kind, count, args.load_seconds)
        print(f"{url} {body} x{count}: {result}", flush=True)
        return result

    endpoint = start_endpoint(training.tracking_uri, Path(args.workdir) / "endpoint.log")
    try:
        for count in clients:
            rows.append((f"endpoint, one PNG per request, {count} client(s)", 1,
                         load(f"{endpoint.url}/predict", "one.png", "image/png", count)))  # fmt: skip
        rows.append(("endpoint, JSON batch 32 per request, 1 client", 32,
                     load(f"{endpoint.url}/invocations", "batch32.json", "application/json", 1)))  # fmt: skip
    finally:
        endpoint.stop()
    if args.ray_python:
        for count, result in measure_ray(args, export.export_dir, bodies, clients, load):
            rows.append((f"Ray Serve 2.60 (`@serve.batch`, same model and batching), one PNG per request, {count} "
                         "client(s)", 1, result))  # fmt: skip
    log_path = Path(args.workdir) / "mlflow-serve.log"
    log_path.unlink(missing_ok=True)
    baseline = start_model_server(promotion.model_uri, training.tracking_uri, log_path)
    try:
        rows.append(("`mlflow models serve` (baseline), JSON batch 32 per request, 1 client", 32,
                     load(f"{baseline.url}/invocations", "batch32.json", "application/json", 1)))  # fmt: skip
        rows.append((f"`mlflow models serve` (baseline), JSON one image per request, {clients[-1]} clients", 1,
                     load(f"{baseline.url}/invocations", "one.json", "application/json", clients[-1])))  # fmt: skip
    finally:
        baseline.stop()
    return rows


# Why our own small ASGI app and not a serving engine: each candidate resolved with `pip install --dry-run -c
# constraints.txt` on 2026-11-28 (the package registry of these machines).
ENGINE_DECISION = (
    "**Why a small Starlette app and not a serving engine.** Each candidate was resolved against our pins "
    "(`pip install --dry-run -c constraints.txt`, 2026-11-28): **MLServer** 1.7.1 (its MLflow runtime, the Open "
    "Inference Protocol, adaptive batching) requires fastapi < 0.116, and Prefect 3.8's server needs the pinned "
    "0.139, so pip falls back to MLServer 1.2.1 of 2022 beside mlserver-mlflow 1.7.1, a mismatched pair; "
    "**BentoML** 1.4.40 needs certifi >= 2026.10.19, which the registry lacks (the reason Prefect 3.9 is out), "
    "1.3.x pins opentelemetry-api 1.20, and pip falls back to BentoML 0.5.3 of 2019; **KServe**'s Python server "
    "(0.16-0.21) requires psutil < 6 against our 7.2 (ResolutionImpossible), so an InferenceService would need "
    "an image of its own; **TF Serving** cannot be installed here (no Debian package, no container registry). "
    "**Ray Serve** 2.60 resolves cleanly and was measured (the Ray Serve rows, `--ray-python`: the same model, "
    "decoding and `@serve.batch` with our batch and wait): on 2 cores every request crosses from its HTTP proxy "
    "actor to the replica through Ray's object store, beside the raylet and GCS processes, and it answers "
    "0.07x the ceiling at 64 clients (p99 over half a second) where our app answers >= 0.5x; its strength, "
    "replicas over a Ray cluster, is what replicas of our stateless endpoint behind a load balancer give "
    "(docs/PRODUCTION.md). Starlette and uvicorn are already in the environment (Prefect's and MLflow's own), "
    "and the batching the app needs is ~150 lines (`cifar/endpoint/batcher.py`)."
)


def ms(value: float) -> str:
    return "n/a (< 100 answers)" if value != value else f"{value:.1f}"  # hey prints no 99% line below 100.


def endpoint_table(rows: list[tuple[str, int, Load]], ceiling: float, batch_size: int) -> str:
    lines = [
        "| server and load | images/s | vs in-process ceiling | p50 ms | p99 ms | answers (non-200) "
        "| load generator CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, per_request, result in rows:
        rate = result.requests_per_second * per_request
        others = sum(count for code, count in result.statuses.items() if code != 200) + result.errors
        lines.append(
            f"| {label} | {rate:,.0f} | {rate / ceiling:.2f}x | {result.p50_ms:.1f} | {ms(result.p99_ms)} | "
            f"{sum(result.statuses.values()):,} ({others}) | {result.client_cpu_seconds:.1f} |"
        )
    lines.append(f"| in-process `serving_bytes` at batch {batch_size} (the ceiling) | {ceiling:,.0f} | 1.00x | | | | |")
    return "\n".join(lines)


def markdown_table(batch_seconds, single_seconds, batch_size: int) -> str:
    labels = {
        "serving_default": "SavedModel `serving_default`, raw uint8 (what TF Serving / the pyfunc run)",
        "serving_bytes": "SavedModel `serving_bytes`, PNG-encoded images",
        "keras": "Keras model in-process (`tf.function`), reference",
    }
    reference = batch_seconds["serving_default"]
    lines = [
        f"| variant | images/s at batch {batch_size} (median) | throughput vs serving_default (paired) | "
        "batch-1 p50 ms | batch-1 p95 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("serving_default", "serving_bytes", "keras"):
        rate = batch_size / common.median(batch_seconds[name])
        # Median of per-call ratios against the serving_default call of the same rotation.
        paired = common.median([base / value for base, value in zip(reference, batch_seconds[name])])
        lines.append(
            f"| {labels[name]} | {rate:,.0f} | {paired:.2f}x | "
            f"{1000 * common.median(single_seconds[name]):.2f} | "
            f"{1000 * common.percentile(single_seconds[name], 0.95):.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_at_start = common.load_average()
    data_dir = common.prepare_bench_data(args.archive, args.workdir)
    config, training, evaluation, export, export_seconds = export_once(args, data_dir)
    print(f"exported {export.export_dir} (test accuracy {evaluation.test_accuracy:.4f}) in {export_seconds:.1f} s")

    from cifar.evaluate import load_split

    images, _labels = load_split(data_dir, "test")
    images = images[:1024]
    png = np.array([tf.io.encode_png(image).numpy() for image in images], dtype=object)
    variants = make_variants(export.export_dir, training.checkpoint_dir, evaluation.epoch)
    batch_seconds, single_seconds = measure_in_process(variants, images, png, args)
    table = markdown_table(batch_seconds, single_seconds, args.batch_size)
    print(table)

    http_text = ""
    if args.http:
        http = measure_http(config, export, training, images, args, data_dir)
        http_rate = args.http_batch / common.median(http["batch"])
        in_process_rate = args.batch_size / common.median(batch_seconds["serving_default"])
        http_text = (
            "\n\n**Over HTTP** (`mlflow models serve -m <logged pyfunc> --env-manager local --workers 1`, JSON "
            '`{"inputs": [...]}` to `/invocations` on 127.0.0.1, one request at a time, after 5 warm-up '
            f"requests): start-up until `/ping` answers {http['startup']:.1f} s; batch 1: p50 "
            f"{1000 * common.median(http['single']):.1f} ms, "
            f"p95 {1000 * common.percentile(http['single'], 0.95):.1f} ms "
            f"over {len(http['single'])} requests; batch {args.http_batch} ({http['payload_kb']:,.0f} KiB of JSON): "
            f"{http_rate:,.0f} images/s (median of 5), "
            f"{http_rate / in_process_rate:.2f}x of in-process serving_default at batch {args.batch_size}. At "
            f"{in_process_rate:,.0f} images/s the model itself needs about "
            f"{1000 * args.http_batch / in_process_rate:.0f} ms of each {1000 * common.median(http['batch']):.0f} ms "
            "batch request; the rest is the HTTP + JSON + MLflow input-conversion path. The HTTP endpoint suits "
            "single-image requests; bulk scoring should call the SavedModel in-process (as above)."
        )
        print(http_text)

    endpoint_text = ""
    if args.endpoint:
        ceiling = args.batch_size / common.median(batch_seconds["serving_bytes"])
        rows = measure_endpoints(config, export, training, images, args, data_dir)
        endpoint_text = (
            "\n\n**Under concurrent clients** (`hey` from Debian's package on the same 2 cores, "
            f"{args.load_seconds:g} s per row after a 3 s warm-up; the endpoint `flows/serve.py` with its defaults, "
            "`mlflow models serve --workers 1` as the baseline; images/s = requests/s x images per request; "
            "the ceiling is this run's in-process `serving_bytes` on PNGs):\n\n"
            + endpoint_table(rows, ceiling, args.batch_size)
            + "\n\n"
            + ENGINE_DECISION
        )
        print(endpoint_text)

    if args.write_docs:
        body = (
            f"The exported SavedModel (`cifar.export.export_model`, TF-Serving layout) of a {args.model} trained "
            f"briefly through `cifar.train.train` (1 epoch x {args.train_steps} steps on the real data; the weights "
            "do not matter for speed) with the default TrainConfig, so the checkpoint carries the "
            "`configure_performance` policy of this CPU (mixed_bfloat16 where the CPU has bfloat16 math) and "
            "the fused batch norm. Loaded with `tf.saved_model.load` in the bench process; inputs are real test "
            f"images. Throughput: {args.batch_calls} calls of batch {args.batch_size} per variant per round, median "
            f"call time over all {args.rounds} rounds; latency: {args.single_calls} single-image calls per variant per "
            "round (p50/p95 over all rounds); after warm-up calls, the variants alternate call by call (order "
            "rotated each call) so load changes hit them alike; the ratio column is the median of per-call ratios "
            "against the serving_default call of the same rotation. Export itself "
            f"(save, reload, verify on the 10,000 test images, `saved_model_cli show`) took {export_seconds:.1f} s.\n\n"
            f"Command: `{common.command_line('serving.py', argv)}`\n\n"
            f"Machine: {common.machine_description(load_at_start)}. Note: {args.note}.\n\n"
            f"{table}{http_text}{endpoint_text}\n"
        )
        common.write_section(SECTION, body)
        print(f"wrote {common.DOCS_PATH}")


if __name__ == "__main__":
    main()
