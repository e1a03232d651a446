"""Batch prediction: given a registered tiny model and unlabelled images of every kind, expect the SavedModel's own
answers in one Parquet file, unreadable files listed and skipped, an input never scored twice, memory that does
not grow with the input, and drift (with its Prefect event) exactly when the images changed."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import struct
import sys
import threading
import time
from pathlib import Path

from flows.runtime import SUPERVISED_ENV

import mlflow
import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest
from fuzz_files import frame
from PIL import Image
from test_evaluate import prepare_fixture_data, write_checkpoints

from cifar.config import MonitorConfig, make_config
from cifar.data.additions import NoUsableImagesError
from cifar.data.convert import encode_examples
from cifar.data.manifest import load_manifest
from cifar.data.synthetic import CLASS_NAMES, write_batch_file, write_image_folder
from cifar.evaluate import evaluate, load_split
from cifar.export import export_model, serving_outputs
from cifar.io import file_digests
from cifar.predict import (
    EXPERIMENT,
    PredictionResult,
    ScoringModel,
    input_digest,
    judge,
    open_source,
    predict,
    read_usable,
    resolve_model,
)
from cifar.quiet import FRAMEWORK_LOGGERS
from cifar.registry import register_and_promote
from flows.ingest import main as ingest_main
from flows.predict import DRIFT_DETECTED
from flows.predict import main as predict_main
from flows.predict import predict as predict_flow
from harness.prefect import prefect_api
from harness.servers import start_prefect_server

LARGE_IMAGES = 60_000  # 176 MiB of pixels in the memory test.
RSS_GROWTH_CAP = 80 * 2**20  # Well below the input's size: one chunk's buffers, the Parquet writer's pages.


@pytest.fixture(scope="module")
def registered(python_archive, tmp_path_factory) -> dict:
    """A tiny model trained, exported and registered as cifar10 v1 (champion, with its monitoring reference)."""
    workdir = tmp_path_factory.mktemp("predict")
    data_dir = prepare_fixture_data(python_archive, workdir)
    checkpoint_dir = workdir / "runs" / "tiny" / "checkpoints"
    write_checkpoints(data_dir, checkpoint_dir, epochs=2)
    tracking_uri = f"sqlite:///{workdir / 'mlflow.db'}"
    config = make_config(
        "default",
        {"train": {"model": "tiny"}, "evaluate": {"flip_tta": False}, "tracking": {"tracking_uri": tracking_uri}},
    )
    evaluation = evaluate(config, data_dir, checkpoint_dir, workdir, mlflow_run_id=None, tracking_uri=None)
    export = export_model(config, data_dir, checkpoint_dir, workdir, evaluation, mlflow_run_id=None, tracking_uri=None)
    images, _ = load_split(data_dir, "test")
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    location = (workdir / "mlartifacts" / "cifar10").as_uri()
    run_id = client.create_run(client.create_experiment("cifar10", artifact_location=location)).info.run_id
    promotion = register_and_promote(
        config, export, data_dir, mlflow_run_id=run_id, tracking_uri=tracking_uri, input_example=images[:3]
    )
    assert promotion.registered_model_version == 1 and promotion.champion
    return {
        "workdir": workdir,
        "data_dir": data_dir,
        "tracking_uri": tracking_uri,
        "images": images,  # The 200 test images, in shard order.
        "expected": serving_outputs(export.export_dir, images, batch_size=200)["class_ids"],
        "model": ScoringModel(resolve_model("models:/cifar10@champion", tracking_uri), tracking_uri),
    }


def score(registered: dict, source, **options) -> PredictionResult:
    return predict(
        source,
        registered["workdir"],
        tracking_uri=registered["tracking_uri"],
        scoring_model=registered["model"],
        **options,
    )


def brightened(images: np.ndarray, factor: float = 1.4) -> np.ndarray:
    return np.clip(images.astype(np.float32) * factor, 0, 255).astype(np.uint8)


def write_source(kind: str, images: np.ndarray, directory, data_dir) -> tuple[str, list[int], list[str]]:
    """The images as a source of `kind`: its path, the order in which it holds them (indices into `images`), and
    the name each gets in the predictions."""
    count = len(images)
    if kind == "npy":
        np.save(directory / "images.npy", images)
        return str(directory / "images.npy"), list(range(count)), [f"images.npy#{index}" for index in range(count)]
    if kind == "batch_file":
        path = write_batch_file(directory / "test_batch", images, np.zeros(count, np.int64), name="test_batch")
        return str(path), list(range(count)), [f"test_batch#{index}" for index in range(count)]
    if kind == "folder":
        labels = np.arange(count) % len(CLASS_NAMES)  # Folder names only; the model never sees them.
        write_image_folder(directory / "photos", images, labels)  # <class>/<index>.png, read in path order.
        names = {f"{CLASS_NAMES[label]}/{index:05d}.png": index for index, label in enumerate(labels)}
        return str(directory / "photos"), [names[name] for name in sorted(names)], sorted(names)
    # The data stage's own test shards, through a glob: read in name order, each image named in its shard.
    shards = load_manifest(data_dir).splits["test"].shards
    names = [f"{Path(shard.path).name}#{index}" for shard in shards for index in range(shard.num_examples)]
    assert len(shards) > 1 and len(names) == count
    return str(data_dir / "test-*.tfrecord"), list(range(count)), names


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["npy", "batch_file", "folder", "tfrecord"])
def test_every_kind_of_source_gets_the_saved_models_answers_image_for_image(registered, tmp_path, kind):
    images = registered["images"]
    path, order, names = write_source(kind, images, tmp_path, registered["data_dir"])

    result = score(registered, path)

    assert (result.kind, result.images, result.problems, result.reused) == (kind, len(images), [], False)
    table = pq.read_table(result.predictions_path)
    assert table.column_names == [
        "image", "class_id", "class_name", *[f"prob_{index}" for index in range(10)], "confidence", "model_version",
    ]  # fmt: skip
    assert table.column("class_id").to_pylist() == registered["expected"][order].tolist()
    assert table.column("class_name").to_pylist() == [CLASS_NAMES[index] for index in registered["expected"][order]]
    probabilities = np.stack([table.column(f"prob_{index}").to_numpy() for index in range(10)], axis=1)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(table.column("confidence").to_numpy(), probabilities.max(axis=1))
    assert set(table.column("model_version").to_pylist()) == {1}
    assert table.column("image").to_pylist() == names
    summary = json.loads(open(result.summary_path).read())
    assert summary["key"] == f"{result.digest[:16]}-cifar10-v1" and summary["class_counts"] == result.class_counts
    assert sum(result.class_counts) == len(images) and os.path.getsize(result.drift_png) > 10_000
    run = mlflow.MlflowClient(tracking_uri=registered["tracking_uri"]).get_run(result.mlflow_run_id)
    assert run.data.tags["model_version"] == "1" and run.data.params["input_digest"] == result.digest
    assert run.data.metrics["images"] == len(images) and "monitor_image_drift" in run.data.metrics


def test_unreadable_files_in_a_folder_are_listed_and_skipped(registered, tmp_path):
    from PIL import Image

    folder = write_image_folder(tmp_path / "photos", registered["images"][:20], np.arange(20) % 10)
    good = sorted(str(path.relative_to(folder)) for path in folder.rglob("*.png"))
    (folder / "cat" / "truncated.png").write_bytes((folder / good[0]).read_bytes()[:120])
    (folder / "notes.txt").write_text("not an image")
    Image.new("RGB", (64, 64), (200, 30, 30)).save(folder / "large.png")
    os.symlink(folder / good[1], folder / "link.png")

    result = score(registered, folder)

    problems = {problem.file: problem.problem for problem in result.problems}
    assert problems == {"cat/truncated.png": "truncated", "notes.txt": "undecodable", "large.png": "size",
                        "link.png": "link"}  # fmt: skip
    assert result.images == 20
    assert pq.read_table(result.predictions_path).column("image").to_pylist() == good
    assert "4 files skipped" in result.summary() and "large.png: size" in result.summary()

    # Opting into a declared resize scores the large image too, and the method is part of the input's identity.
    resized = score(registered, open_source(folder, resize="bilinear"))
    assert resized.images == 21 and resized.resize == "bilinear" and resized.digest != result.digest
    assert "large.png" in pq.read_table(resized.predictions_path).column("image").to_pylist()


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("folder", "1 file left out: notes.txt (undecodable: not an image PIL can read)"),
        ("npy", "it holds no images (.npy array)"),
        ("batch_file", "it holds no images (CIFAR batch file)"),
        ("tfrecord", "it holds no images (TFRecords)"),
    ],
)
def test_an_input_with_no_readable_image_is_refused_naming_what_could_not_be_read(registered, tmp_path, kind, message):
    # Issue 39: a folder holding only a text file ended in the drift histogram's `Size mismatch between "values" ...`.
    if kind == "folder":
        path = tmp_path / "photos"
        path.mkdir()
        (path / "notes.txt").write_text("not an image")
    elif kind == "tfrecord":
        path = tmp_path / "empty.tfrecord"
        path.write_bytes(b"")
    else:
        path, _, _ = write_source(kind, np.zeros((0, 32, 32, 3), np.uint8), tmp_path, registered["data_dir"])
    before = recorded(registered)

    with pytest.raises(NoUsableImagesError) as raised:
        score(registered, path)

    assert str(raised.value) == f"no usable image in {Path(path).resolve()}: {message}"
    assert recorded(registered) == before  # No predictions, no MLflow run.


def recorded(registered: dict) -> tuple[list[str], list[str]]:
    """The workdir's prediction outputs (not their locks) and the ids of its prediction runs in MLflow."""
    root = registered["workdir"] / "predictions"
    outputs = sorted(path.name for path in root.iterdir() if not path.name.endswith(".lock")) if root.exists() else []
    client = mlflow.MlflowClient(tracking_uri=registered["tracking_uri"])
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = [run.info.run_id for run in client.search_runs([experiment.experiment_id])] if experiment else []
    return outputs, sorted(runs)


# Found by the fuzz suite (tests/test_fuzz_prediction_inputs.py, issue 39); the readers alone, no model.


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        (frame(b"x" * 100, length=2**40), "record 3 (byte 9,378) states 1,099,511,627,776 bytes, over the 65,536"),
        (frame(b"x" * 100, length=200), "record 3 (byte 9,378) states 200 bytes, more than the file holds"),
        (frame(b"\x80abc"), "a record is not an Example of a 32x32 image"),
    ],
    ids=["a record of a TiB", "a record past the end", "a record TensorFlow quotes in bytes"],
)
def test_a_shard_whose_records_cannot_be_read_safely_is_skipped_whole(tmp_path, payload, detail):
    # A 1 TiB record crashed the process (TensorFlow allocates what a header states); non-UTF-8 bytes in
    # TensorFlow's own message leaked a UnicodeDecodeError.
    images = np.random.default_rng(5).integers(0, 256, (3, 32, 32, 3), np.uint8)
    good = b"".join(frame(bytes(row)) for row in encode_examples(images, np.zeros(3, np.int64)))
    (tmp_path / "a.tfrecord").write_bytes(good)
    (tmp_path / "b.tfrecord").write_bytes(good + payload)

    chunks = list(read_usable(open_source(tmp_path)))

    [problem] = [problem for chunk, _ in chunks for problem in chunk.problems]
    assert (problem.file, problem.problem) == ("b.tfrecord", "undecodable") and detail in problem.detail
    np.testing.assert_array_equal(np.concatenate([chunk.images for chunk, _ in chunks]), images)


def test_a_batch_file_of_any_pickle_protocol_is_a_source(tmp_path):
    # Protocols 0 and 1 (no PROTO opcode first) were refused as "not a source of images".
    images = np.random.default_rng(6).integers(0, 256, (2, 32, 32, 3), np.uint8)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        rows = images.transpose(0, 3, 1, 2).reshape(2, 3072)
        (tmp_path / "test_batch").write_bytes(pickle.dumps({"data": rows, "labels": [0, 1]}, protocol))
        [(chunk, _)] = list(read_usable(open_source(tmp_path / "test_batch")))
        np.testing.assert_array_equal(chunk.images, images)


@pytest.mark.filterwarnings("error")
def test_a_npy_header_stating_more_images_than_the_file_holds_is_refused_before_any_work(tmp_path):
    # A header stating (2, 2**31, 2**31) made NumPy warn of an overflow on the terminal while mapping the file.
    for shape, stated in (
        ((2, 2**31, 2**31), "holds uint8 (2, 2147483648, 2147483648)"),
        ((10**12, 32, 32, 3), "states 1,000,000,000,000 images in its header but holds 64"),
    ):
        path = tmp_path / "images.npy"
        with open(path, "wb") as handle:
            np.lib.format.write_array_header_1_0(handle, {"descr": "|u1", "fortran_order": False, "shape": shape})
            handle.write(bytes(64))
        with pytest.raises(ValueError, match=re.escape(stated)):
            open_source(path)
    # Found by make fuzz: a header NumPy tokenizes as an old-style one leaked tokenize.TokenError.
    header = b"{'descr': '|u1', 'fortran_order': False, 'shape': (0, 32, 32, 3), "
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", 118) + header.ljust(117) + b"\n")
    with pytest.raises(ValueError, match="is not a readable .npy file: .*EOF in multi-line statement"):
        open_source(path)


def test_the_same_input_is_never_scored_twice(registered, tmp_path):
    path = tmp_path / "test.npy"
    np.save(path, registered["images"])
    client = mlflow.MlflowClient(tracking_uri=registered["tracking_uri"])

    def runs() -> int:
        return len(client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id]))

    first = score(registered, path)
    written = os.stat(first.predictions_path).st_mtime_ns
    runs_before = runs()

    again = score(registered, path)
    assert again.reused and not first.reused and again.key == first.key
    assert os.stat(again.predictions_path).st_mtime_ns == written and runs() == runs_before
    assert "already scored" in again.summary()

    # Judged again under other thresholds from the recorded profile: the verdict changes, nothing is scored.
    strict = score(registered, path, settings=MonitorConfig(max_image_drift=0.0))
    assert strict.reused and strict.drift and not first.drift and runs() == runs_before

    # One byte more is another input: a new key, scored.
    changed = registered["images"].copy()
    changed[0, 0, 0, 0] ^= 1
    np.save(path, changed)
    other = score(registered, path)
    assert not other.reused and other.key != first.key and runs() == runs_before + 1


@pytest.mark.slow
def test_memory_stays_bounded_for_an_input_larger_than_the_cap(registered, tmp_path):
    path = tmp_path / "large.npy"
    large = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(LARGE_IMAGES, 32, 32, 3))
    for start in range(0, LARGE_IMAGES, len(registered["images"])):
        large[start : start + len(registered["images"])] = registered["images"]
    large.flush()
    del large
    assert os.path.getsize(path) > 2 * RSS_GROWTH_CAP
    np.save(tmp_path / "warm-up.npy", registered["images"][::-1])
    score(registered, tmp_path / "warm-up.npy")  # Everything imported, allocated and warmed up.
    process = psutil.Process()
    baseline = peak = process.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = score(registered, path)
    finally:
        done.set()
        sampler.join()

    assert result.images == LARGE_IMAGES
    assert pq.ParquetFile(result.predictions_path).metadata.num_row_groups == LARGE_IMAGES // 1000  # Streamed.
    print(f"peak RSS growth scoring {LARGE_IMAGES:,} images: {(peak - baseline) / 2**20:.0f} MiB")
    assert peak - baseline < RSS_GROWTH_CAP, f"RSS grew by {(peak - baseline) / 2**20:.0f} MiB"


def test_a_version_without_a_reference_is_reported_not_judged(registered):
    result = score(registered, registered["data_dir"] / "test-*.tfrecord")
    report, note = judge(result.profile, result.class_counts, result.low_confidence_share, None, MonitorConfig())
    assert report is None and "no monitoring reference" in note


def test_the_command_line_refuses_a_bad_input_before_any_work(registered, tmp_path, capsys):
    floats = tmp_path / "floats.npy"
    np.save(floats, registered["images"].astype(np.float32))

    code = predict_main(["--input", str(floats), "--workdir", str(tmp_path / "w")])

    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {floats} holds float32 (200, 32, 32, 3); expected uint8 images (N, 32, 32, 3): integers 0..255, "
        "channels last (a folder of image files can be resized with a declared method)"
    ]
    assert not (tmp_path / "w" / "predictions").exists()
    assert predict_main(["--input", str(tmp_path / "missing"), "--model", "models:/cifar10"]) == 2
    assert capsys.readouterr().err.startswith("error: model must be models:/<name>@<alias> or models:/<name>/<version>")


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """A real Prefect server (events persisted twice a second) that this process's flows report to."""
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server = start_prefect_server(
        tmp_path_factory.mktemp("prefect-home"), PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL="0.5"
    )
    try:
        EventsWorker.drain_all()  # Events go to a worker made under this server's settings, not an earlier one.
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            yield server
            EventsWorker.drain_all()
    finally:
        server.stop()


def drift_events(server, digest: str, timeout: float = 30.0) -> list[dict]:
    """The `cifar.drift.detected` events for input `digest` once the server has stored them (empty if none)."""
    deadline = time.monotonic() + timeout
    while True:
        response = prefect_api.post(
            f"{server.api_url}/events/filter",
            json={
                "filter": {"event": {"name": ["cifar.drift.detected"]}, "occurred": {"since": "2000-01-01T00:00:00Z"}}
            },
        )
        events = [event for event in response.json()["events"] if event["payload"]["input_digest"] == digest]
        if events or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


@pytest.mark.integration
def test_brightened_images_raise_the_drift_flag_and_its_event_the_originals_do_not(
    registered, prefect_server, tmp_path
):
    from prefect.events.worker import EventsWorker

    workdir = str(registered["workdir"])
    original, bright = tmp_path / "original.npy", tmp_path / "brightened.npy"
    np.save(original, registered["images"])
    np.save(bright, brightened(registered["images"]))

    states = {path: predict_flow(input=str(path), workdir=workdir, return_state=True) for path in (original, bright)}
    EventsWorker.drain_all()

    calm, drifted = states[original], states[bright]
    assert calm.is_completed() and calm.name == "Completed" and not calm.result()["drift"]
    assert drifted.is_completed() and drifted.name == DRIFT_DETECTED
    summary = drifted.result()
    assert summary["drift"] and "image drift: Jensen-Shannon divergence" in drifted.message
    artifacts = prefect_api.post(
        f"{prefect_server.api_url}/artifacts/filter", json={"artifacts": {"key": {"any_": ["cifar-drift"]}}}
    ).json()
    assert [artifact["flow_run_id"] for artifact in artifacts] == [str(drifted.state_details.flow_run_id)]

    [event] = drift_events(prefect_server, summary["digest"])
    assert event["resource"]["prefect.resource.id"] == "cifar.model.cifar10.1"
    assert event["payload"]["workdir"] == workdir and event["payload"]["version"] == 1
    assert event["payload"]["values"]["monitor_image_drift"] > MonitorConfig().max_image_drift
    assert drift_events(prefect_server, input_digest(open_source(original)), timeout=2) == []


@pytest.mark.integration
def test_the_data_doors_end_with_one_error_line_when_nothing_is_usable(
    registered, prefect_server, python_archive, tmp_path, monkeypatch, capfd
):
    """Issue 39's two failures end to end, as the command line's child runs them (in process, on the module's
    Prefect server): `flows/predict.py --input` a folder holding only a text file, `flows/ingest.py --add` a
    folder whose only class folder is misspelt. Each ends with exit 1 and one `error:` line naming the files."""
    monkeypatch.setenv(SUPERVISED_ENV, "1")  # The flow runs here, as in the command line's supervised child.
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [logging.StreamHandler(sys.stderr)])  # What log_to_file changes, restored.
    for name in FRAMEWORK_LOGGERS:
        for attribute in ("handlers", "level", "propagate"):
            monkeypatch.setattr(logging.getLogger(name), attribute, getattr(logging.getLogger(name), attribute))
    monkeypatch.setenv("MLFLOW_CONFIGURE_LOGGING", os.environ.get("MLFLOW_CONFIGURE_LOGGING", "true"))
    text_only = tmp_path / "incoming"
    text_only.mkdir()
    (text_only / "notes.txt").write_text("not an image")
    misspelt = tmp_path / "new-labels"
    (misspelt / "dragon").mkdir(parents=True)
    Image.fromarray(registered["images"][0]).save(misspelt / "dragon" / "a.png")
    before = recorded(registered)
    capfd.readouterr()

    predicted = predict_main(["--input", str(text_only), "--workdir", str(registered["workdir"])])
    predict_errors = capfd.readouterr().err
    ingested = ingest_main([
        "--add", str(misspelt), "--workdir", str(tmp_path / "workdir"), "--source", python_archive,
        "--sha256", file_digests(python_archive)["sha256"], "--set", "data.expect_official_counts=false",
    ])  # fmt: skip
    ingest_errors = capfd.readouterr().err

    for code, stderr, line in (
        (predicted, predict_errors, f"error: no usable image in {text_only}: 1 file left out: notes.txt (undecodable: "
                                    "not an image PIL can read) (full log: "),
        (ingested, ingest_errors, f"error: no usable image in {misspelt}: 1 file left out: dragon/a.png "
                                  "(unknown_class: folder 'dragon' is not a class name (airplane, "),
    ):  # fmt: skip
        errors = [text for text in stderr.splitlines() if text.startswith("error:")]
        assert code == 1 and len(errors) == 1 and errors[0].startswith(line), stderr[-3000:]
        assert "Traceback" not in stderr
    assert recorded(registered) == before  # No predictions, no MLflow run.
    assert not (tmp_path / "workdir" / "data" / "additions").exists()
    assert not (tmp_path / "workdir" / "data" / "snapshots").exists()
