"""Serving: the registered champion behind a real `mlflow models serve` process answers like the SavedModel."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request

import numpy as np
import pytest
from servers import BIN_DIR, HOST, ProcessHandle, free_port, wait_for_http
from test_evaluate import prepare_fixture_data, write_checkpoints

from cifar.config import make_config
from cifar.data.synthetic import CLASS_NAMES
from cifar.evaluate import evaluate, load_split
from cifar.export import export_model, serving_outputs
from cifar.registry import register_and_promote

SERVER_START_SECONDS = 240  # Importing MLflow and TensorFlow on a busy 2-core machine is slow.


@pytest.mark.integration
def test_mlflow_models_serve_answers_like_the_saved_model(python_archive, tmp_path):
    workdir = tmp_path / "workdir"
    data_dir = prepare_fixture_data(python_archive, workdir)
    checkpoint_dir = workdir / "runs" / "tiny" / "checkpoints"
    write_checkpoints(data_dir, checkpoint_dir, epochs=1)
    tracking_uri = f"sqlite:///{workdir / 'mlflow.db'}"
    config = make_config(
        "default",
        {"train": {"model": "tiny"}, "evaluate": {"flip_tta": False}, "tracking": {"tracking_uri": tracking_uri}},
    )
    evaluation = evaluate(config, data_dir, checkpoint_dir, workdir, mlflow_run_id=None, tracking_uri=None)
    exported = export_model(
        config, data_dir, checkpoint_dir, workdir, evaluation, mlflow_run_id=None, tracking_uri=None
    )
    images, _ = load_split(data_dir, "test")
    promotion = register_and_promote(
        config, exported, evaluation.test_accuracy, mlflow_run_id=None, tracking_uri=None, input_example=images[:2]
    )
    assert promotion.champion and promotion.registered_model_version == 1

    port = free_port()
    environment = {key: value for key, value in os.environ.items() if not key.startswith("MLFLOW_")}
    environment.update(
        MLFLOW_TRACKING_URI=tracking_uri,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        PATH=f"{BIN_DIR}{os.pathsep}{environment.get('PATH', '')}",
    )
    command = [
        str(BIN_DIR / "mlflow"),
        "models",
        "serve",
        "-m",
        "models:/cifar10@champion",
        "--env-manager",
        "local",
        "-h",
        HOST,
        "-p",
        str(port),
        "--workers",
        "1",
    ]
    log_path = tmp_path / "serve.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            env=environment,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = ProcessHandle(process, log_path, environment)
    try:
        wait_for_http(f"http://{HOST}:{port}/ping", server, SERVER_START_SECONDS)
        batch = images[:20]
        request = urllib.request.Request(
            f"http://{HOST}:{port}/invocations",
            data=json.dumps({"inputs": batch.tolist()}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
    finally:
        server.stop()

    predictions = answer["predictions"]
    expected = serving_outputs(exported.export_dir, batch, batch_size=len(batch))
    assert predictions["class_ids"] == expected["class_ids"].tolist()
    assert predictions["class_names"] == [CLASS_NAMES[index] for index in expected["class_ids"]]
    np.testing.assert_allclose(np.array(predictions["probabilities"]), expected["probabilities"], atol=1e-6)
