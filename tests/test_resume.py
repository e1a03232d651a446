"""Kill-and-resume: a training process killed with SIGKILL mid-run loses no epoch and repeats none.

The kill test runs with both optimizers: SGD, and Muon on the conv filters (`train.optimizer: muon`),
whose momentum buffers must come back from the checkpoint like SGD's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from cifar.checkpoints import load_index
from cifar.config import DataConfig
from cifar.data.prepare import prepare_data

WORKER = Path(__file__).with_name("train_worker.py")
REPOSITORY = WORKER.parents[1]
EPOCHS = 4
CONFIG = {
    "train": {
        "model": "tiny",
        "epochs": EPOCHS,
        "batch_size": 32,
        "learning_rate": 0.4,
        "schedule": "cosine",
        "keep_checkpoints": 2,
        "run_name": "resume-test",
    },
    "tracking": {"system_metrics": False},
}


@pytest.fixture(scope="module")
def data_dir(python_archive, tmp_path_factory) -> str:
    config = DataConfig(source=python_archive, expect_official_counts=False, validation_size=100)
    return prepare_data(config, tmp_path_factory.mktemp("resume-data")).data_dir


def worker_command(data_dir: str, workdir: Path, *extra: str, config: dict = CONFIG) -> list[str]:
    return [sys.executable, str(WORKER), data_dir, str(workdir), json.dumps(config), *extra]


def worker_environment() -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if key not in {"TF_CONFIG", "MLFLOW_TRACKING_URI"}}
    environment.update({"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    return environment


def epochs_reported(output: str) -> list[int]:
    return [json.loads(line[len("EPOCH ") :])["epoch"] for line in output.splitlines() if line.startswith("EPOCH ")]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "muon"])
def test_killed_training_resumes_without_losing_or_repeating_epochs(data_dir, tmp_path, optimizer):
    config = {**CONFIG, "train": {**CONFIG["train"], "optimizer": optimizer}}
    workdir = tmp_path / "work"
    checkpoint_dir = workdir / "runs" / "resume-test" / "checkpoints"
    log_path = tmp_path / "first.log"

    # First attempt: pauses after every epoch so the kill lands mid-run, after >= 1 checkpoint.
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            worker_command(data_dir, workdir, "--epoch-sleep", "5", config=config),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPOSITORY,
            env=worker_environment(),
        )
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and process.poll() is None:
                index = load_index(checkpoint_dir) if (checkpoint_dir / "index.json").is_file() else None
                if index is not None and index.latest is not None:
                    break
                time.sleep(0.2)
            assert process.poll() is None, log_path.read_text()[-4000:]
            os.kill(process.pid, signal.SIGKILL)
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    killed_at = load_index(checkpoint_dir).latest.epoch
    assert 1 <= killed_at < EPOCHS
    state = json.loads((checkpoint_dir.parent / "state.json").read_text())
    assert state["status"] == "running"

    # Second attempt: the same command resumes after the last checkpointed epoch.
    completed = subprocess.run(
        worker_command(data_dir, workdir, config=config),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPOSITORY,
        env=worker_environment(),
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert epochs_reported(completed.stdout) == list(range(killed_at + 1, EPOCHS + 1))
    result = json.loads(next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["epochs_completed"] == EPOCHS
    assert result["mlflow_run_id"] == state["mlflow_run_id"]  # The same MLflow run continues.
    # The optimizer's step counter continued too: every epoch's steps counted exactly once.
    assert result["optimizer_steps"] == EPOCHS * (400 // 32)

    # Exactly one history entry and one MLflow value per epoch: no gaps, no duplicates.
    history = json.loads((checkpoint_dir.parent / "history.json").read_text())
    assert history["epoch"] == list(range(1, EPOCHS + 1))
    assert all(len(values) == EPOCHS for values in history.values())
    client = mlflow.MlflowClient(result["tracking_uri"])
    for key in ("val_accuracy", "loss", "learning_rate"):
        steps = [metric.step for metric in client.get_metric_history(result["mlflow_run_id"], key)]
        assert sorted(steps) == list(range(1, EPOCHS + 1)), key
    experiment = client.get_experiment_by_name("cifar10")
    assert len(client.search_runs([experiment.experiment_id])) == 1
    assert client.get_run(result["mlflow_run_id"]).info.status == "FINISHED"

    # The checkpoint directory holds the last 2 epochs plus the best, and nothing half-written.
    index = load_index(checkpoint_dir)
    assert {entry.epoch for entry in index.entries} >= {EPOCHS - 1, EPOCHS}
    assert not list(checkpoint_dir.glob(".tmp-*"))
    names = {path.name for path in checkpoint_dir.glob("epoch-*")}
    assert names == {name for entry in index.entries for name in (entry.model_path, entry.eval_weights_path)}

    # The resumed run trained with the requested optimizer, and checkpointed its state again.
    import keras

    import cifar.train  # noqa: F401  Registers the optimizers and the loss before deserializing.

    saved = keras.models.load_model(checkpoint_dir / index.latest.model_path)
    assert type(saved.optimizer).__name__ == {"sgd": "GroupedSGD", "muon": "ConvMuon"}[optimizer]


@pytest.mark.slow
def test_epochs_checkpointed_but_not_reported_are_backfilled_once(data_dir, tmp_path, stopped_after_epoch):
    from cifar.config import make_config
    from cifar.train import train

    def config(epochs: int):
        return make_config(
            "default",
            {
                "train": {**CONFIG["train"], "epochs": epochs, "run_name": "backfill"},
                "tracking": {"system_metrics": False},
            },
        )

    # The process dies after epoch 2's checkpoint but before MLflow hears about epoch 2.
    with stopped_after_epoch(2):
        train(config(3), data_dir, tmp_path)
    checkpoint_dir = tmp_path / "runs" / "backfill" / "checkpoints"
    assert load_index(checkpoint_dir).latest.epoch == 2
    # A kill between writing history.json and index.json leaves an epoch the index does not list.
    history_path = checkpoint_dir.parent / "history.json"
    stale = json.loads(history_path.read_text())
    for values in stale.values():
        values.append(999.0)
    stale["epoch"][-1] = 3
    history_path.write_text(json.dumps(stale))

    result = train(config(3), data_dir, tmp_path)
    assert result.epochs_completed == 3
    client = mlflow.MlflowClient(result.tracking_uri)
    for key in ("val_accuracy", "loss"):
        assert sorted(metric.step for metric in client.get_metric_history(result.mlflow_run_id, key)) == [1, 2, 3]
    history = json.loads(history_path.read_text())
    assert history["epoch"] == [1, 2, 3]
    assert 999.0 not in history["loss"]
    assert 999.0 not in [metric.value for metric in client.get_metric_history(result.mlflow_run_id, "loss")]


class SigtermAt(__import__("keras").callbacks.Callback):
    """Sends this process SIGTERM after step `step` of epoch `epoch` (1-based), as `kill PID` would."""

    def __init__(self, epoch: int, step: int):
        super().__init__()
        self.at, self.epoch = (epoch, step), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch + 1

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch + 1) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_sigterm_saves_mid_epoch_and_the_next_run_continues_from_the_next_step(data_dir, tmp_path):
    from cifar import tracking
    from cifar.config import make_config
    from cifar.train import TrainingPreempted, train

    # EMA on: the fit of the rest of an epoch must hand the raw weights, not their average, to the next one.
    settings = {**CONFIG["train"], "epochs": 3, "run_name": "sigterm", "ema_decay": 0.9}
    config = make_config("default", {"train": settings, "tracking": {"system_metrics": False}})
    steps_per_epoch = 400 // 32
    checkpoint_dir = tmp_path / "runs" / "sigterm" / "checkpoints"
    before = signal.getsignal(signal.SIGTERM)

    with pytest.raises(TrainingPreempted, match="saved after step 5 of 12 in epoch 2; run the same command again"):
        train(config, data_dir, tmp_path, callbacks=[SigtermAt(epoch=2, step=3)])
    assert signal.getsignal(signal.SIGTERM) is before  # TF's handler owned SIGTERM only while training.
    index = load_index(checkpoint_dir)
    # TF's handler acts at the step after it saw the signal and saves after the next: step 3 + 2.
    assert index.latest.epoch == 1 and (index.partial.epoch, index.partial.step) == (2, 5)
    assert (checkpoint_dir / index.partial.model_path).is_file()
    state = json.loads((checkpoint_dir.parent / "state.json").read_text())
    client = mlflow.MlflowClient(tracking.resolve_tracking_uri(config.tracking, tmp_path))
    assert state["status"] == "preempted" and client.get_run(state["mlflow_run_id"]).info.status == "KILLED"

    result = train(config, data_dir, tmp_path)
    assert result.epochs_completed == 3 and result.mlflow_run_id == state["mlflow_run_id"]
    for key in ("loss", "accuracy", "val_accuracy", "epoch_seconds"):  # Each epoch once, in the same run.
        assert sorted(metric.step for metric in client.get_metric_history(result.mlflow_run_id, key)) == [1, 2, 3]
    index = load_index(checkpoint_dir)
    assert index.partial is None and not list(checkpoint_dir.glob("*-step-*"))
    history = json.loads((checkpoint_dir.parent / "history.json").read_text())
    assert history["epoch"] == [1, 2, 3]
    import keras

    import cifar.train  # noqa: F401  Registers the optimizers and the loss before deserializing.

    saved = keras.models.load_model(checkpoint_dir / index.latest.model_path)
    assert int(saved.optimizer.iterations.numpy()) == 3 * steps_per_epoch  # No step lost, none repeated.
