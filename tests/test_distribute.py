"""Devices and strategies: clear errors for bad requests, MirroredStrategy and two real workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from cifar import distribute
from cifar.checkpoints import load_index
from cifar.config import DataConfig, TrainConfig, make_config
from cifar.data.prepare import prepare_data
from cifar.train import train
from harness.ports import free_ports

WORKER = Path(__file__).with_name("train_worker.py")
REPOSITORY = WORKER.parents[1]
TINY = {"model": "tiny", "epochs": 2, "batch_size": 32, "learning_rate": 0.4, "schedule": "constant"}
CONFIG_JSON = json.dumps({"train": TINY, "tracking": {"system_metrics": False}})


@pytest.fixture(scope="module")
def data_dir(python_archive, tmp_path_factory) -> str:
    config = DataConfig(source=python_archive, expect_official_counts=False, validation_size=100)
    return prepare_data(config, tmp_path_factory.mktemp("distribute-data")).data_dir


def cluster(ports: list[int], index: int, task_type: str = "worker") -> str:
    return json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]}, "task": {"type": task_type, "index": index}}
    )


def worker_environment(**extra: str) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if key not in {"TF_CONFIG", "MLFLOW_TRACKING_URI"}}
    environment.update({"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", **extra})
    return environment


def parse_result(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, output[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_gpu_requests_beyond_this_machine_are_clear_errors():
    with pytest.raises(ValueError, match=r"gpus=2 requested but this machine has 0 GPU"):
        distribute.resolve_gpu_ids(2, available=0)
    with pytest.raises(ValueError, match=r"ids \[3\] do not exist"):
        distribute.resolve_gpu_ids([0, 3], available=2)
    assert distribute.resolve_gpu_ids([1], available=2) == [1]
    assert distribute.resolve_gpu_ids(0, available=4) == []
    gpus = len(__import__("tensorflow").config.list_physical_devices("GPU"))
    with pytest.raises(ValueError, match="GPU"):
        distribute.plan_devices(TrainConfig(gpus=gpus + 1))


def test_global_batch_must_split_across_all_replicas_of_the_cluster():
    three_workers = json.dumps({"cluster": {"worker": ["a:1", "b:2", "c:3"]}, "task": {"type": "worker", "index": 1}})
    with pytest.raises(ValueError, match="divisible by the 3 replicas"):
        distribute.plan_devices(TrainConfig(batch_size=128), tf_config=three_workers)
    plan = distribute.plan_devices(TrainConfig(batch_size=129), tf_config=three_workers)
    assert plan.num_replicas == 3 and not plan.is_chief


def test_chief_is_the_chief_task_or_worker_zero():
    assert distribute.cluster_task(cluster([1, 2], 0)).is_chief
    assert not distribute.cluster_task(cluster([1, 2], 1)).is_chief
    with_chief = {"cluster": {"chief": ["c:1"], "worker": ["w:2"]}, "task": {"type": "worker", "index": 0}}
    assert not distribute.cluster_task(json.dumps(with_chief)).is_chief
    with_chief["task"] = {"type": "chief", "index": 0}
    task = distribute.cluster_task(json.dumps(with_chief))
    assert task.is_chief and task.num_workers == 2
    assert distribute.cluster_task("") is None
    with pytest.raises(ValueError, match="TF_CONFIG"):
        distribute.cluster_task("{not json")
    with pytest.raises(ValueError, match="not in its cluster"):
        distribute.cluster_task(cluster([1, 2], 5))


def test_bad_device_request_fails_before_any_work(data_dir, tmp_path):
    config = make_config("default", {"train": {**TINY, "gpus": [7]}})
    with pytest.raises(ValueError, match="do not exist"):
        train(config, data_dir, tmp_path / "work")
    assert not (tmp_path / "work").exists()


def test_the_strategys_device_prefetch_runs_without_the_tf_data_autotuner():
    # The autotuner's thread made `model.fit` sit idle up to a minute after the last epoch (compat).
    import tensorflow as tf

    strategy = distribute.create_strategy(distribute.plan_devices(TrainConfig(model="tiny")))
    options = tf.data.Options()
    options.autotune.enabled = False
    batches = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(2).with_options(options)))
    assert next(batches).numpy().tolist() == [0, 1]
    # OneDeviceStrategy feeds its device through a MultiDeviceIterator: one dataset per device.
    device_iterator = batches._iterators[0]._iterator._device_iterators[0]
    assert device_iterator._dataset.options().autotune.enabled is False


# In a fresh process: TensorFlow's mallopt call is once per process, and this one's may already have been made.
FREED_MEMORY = """
import resource
import numpy as np
import cifar._keras_imports
import tensorflow as tf
from cifar import compat, distribute
from cifar.config import TrainConfig

def page_faults_of_reused_blocks():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(100):
        block = np.ones(2 * 1024 * 1024, np.uint8)  # 2 MiB, each page written: under numpy's huge-page size.
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

for _ in tf.data.Dataset.from_generator(lambda: iter(()), output_signature=tf.TensorSpec([], tf.int8)):
    pass
patched = page_faults_of_reused_blocks()
distribute.create_strategy(distribute.plan_devices(TrainConfig(model="tiny")))
page_faults_of_reused_blocks()  # The first block is new to the heap.
print(patched, page_faults_of_reused_blocks(), compat.undo_generator_malloc_patch())
"""


@pytest.mark.slow
def test_a_strategy_gives_back_the_reuse_of_freed_memory_that_a_generator_dataset_takes_away():
    # TF 2.21's first GeneratorDataset fixes glibc's mmap threshold at 128 KiB (compat.undo_generator_malloc_patch):
    # each 2 MiB block is then mapped afresh, 512 page faults a time; a strategy sets glibc's reuse back.
    result = subprocess.run([sys.executable, "-c", FREED_MEMORY], cwd=REPOSITORY, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    patched, restored, undone = result.stdout.split()
    assert int(restored) < 1_000 and undone == "True", result.stdout
    assert int(patched) > 100 * 512 * 0.9, result.stdout  # Gone in a TensorFlow without the patch: drop the undo.


@pytest.mark.slow
def test_mirrored_strategy_over_two_cpu_devices_keeps_global_batch_semantics(data_dir, tmp_path):
    # Logical devices must be configured before TensorFlow starts: fresh processes, run side by side.
    processes = {
        devices: subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                data_dir,
                str(tmp_path / f"work-{devices}"),
                CONFIG_JSON,
                "--logical-cpus",
                str(devices),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=worker_environment(),
            cwd=REPOSITORY,
        )
        for devices in (1, 2)
    }
    runs = {}
    try:
        for devices, process in processes.items():
            stdout, stderr = process.communicate(timeout=300)
            assert process.returncode == 0, stderr[-4000:]
            runs[devices] = parse_result(stdout)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
    one, two = runs[1], runs[2]
    assert one["num_replicas"] == 1 and two["num_replicas"] == 2
    # The configured batch is global: each of two replicas computes half of it ...
    assert one["replica_batches"] == [32]
    assert two["replica_batches"] == [16, 16]
    # ... so an epoch has the same number of optimizer steps: 400 examples // 32 = 12 per epoch.
    assert one["optimizer_steps"] == two["optimizer_steps"] == 2 * 12
    assert two["epochs_completed"] == 2
    assert two["val_accuracy"] > 0.2


@pytest.mark.slow
def test_two_workers_train_together_into_one_run_and_one_checkpoint_directory(data_dir, tmp_path):
    workdir = tmp_path / "shared-work"
    ports = free_ports(2)
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), data_dir, str(workdir), CONFIG_JSON],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPOSITORY,
            env=worker_environment(TF_CONFIG=cluster(ports, index)),
        )
        for index in range(2)
    ]
    outputs = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=240)
            assert process.returncode == 0, stderr[-4000:]
            outputs.append(parse_result(stdout))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    chief, worker = outputs
    assert chief["is_chief"] and not worker["is_chief"]
    assert chief["num_replicas"] == 2
    assert worker["mlflow_run_id"] is None
    # Both workers stepped together, so they agree on every metric.
    assert chief["metrics"]["loss"] == pytest.approx(worker["metrics"]["loss"])

    # Exactly one run directory, one checkpoint directory, one MLflow run with one value per epoch.
    assert [path.name for path in (workdir / "runs").iterdir()] == [chief["run_name"]]
    index = load_index(chief["checkpoint_dir"])
    assert index.latest.epoch == 2
    client = mlflow.MlflowClient(chief["tracking_uri"])
    experiment = client.get_experiment_by_name("cifar10")
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_id for run in runs] == [chief["mlflow_run_id"]]
    assert [metric.step for metric in client.get_metric_history(chief["mlflow_run_id"], "val_accuracy")] == [1, 2]
    assert chief["optimizer_steps"] == 2 * 12  # Global batches of 32: 16 per worker per step.
