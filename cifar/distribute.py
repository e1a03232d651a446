"""Which devices train, and the `tf.distribute` strategy over them.

`plan_devices` checks the request (`train.gpus`: 0 = CPU, N = the first N GPUs, a list = those ids)
before any data or model work; `create_strategy` builds one device, Mirrored over local devices, or
MultiWorkerMirrored when `TF_CONFIG` makes the process one worker of a cluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import tensorflow as tf

from cifar import compat
from cifar.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class ClusterTask:
    """This process's place in a TF_CONFIG cluster."""

    task_type: str
    task_id: int
    num_workers: int  # Chief plus workers: every process that trains.
    is_chief: bool
    spec: dict[str, list[str]]  # The cluster: job name -> "host:port" of each task.


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """The local devices and the replica count a training run will use."""

    device_type: str  # "CPU" or "GPU".
    devices: tuple[str, ...]  # Local logical device names, e.g. ("/gpu:0", "/gpu:1").
    gpu_ids: tuple[int, ...]  # Physical GPU ids (empty on CPU).
    cluster: ClusterTask | None  # None outside a TF_CONFIG cluster.

    @property
    def num_workers(self) -> int:
        return self.cluster.num_workers if self.cluster else 1

    @property
    def num_replicas(self) -> int:
        return len(self.devices) * self.num_workers

    @property
    def is_chief(self) -> bool:
        return self.cluster is None or self.cluster.is_chief

    def summary(self) -> str:
        """One line for logs and MLflow tags, e.g. '2 x GPU [0, 1], 1 worker(s)'."""
        ids = f" {list(self.gpu_ids)}" if self.gpu_ids else ""
        workers = f"{self.num_workers} worker(s), {self.num_replicas} replica(s)"
        return f"{len(self.devices)} x {self.device_type}{ids}, {workers}"


def cluster_task(tf_config: str | None = None) -> ClusterTask | None:
    """Parses TF_CONFIG (or the given JSON); None when this process is not part of a cluster."""
    text = os.environ.get("TF_CONFIG", "") if tf_config is None else tf_config
    if not text.strip():
        return None
    try:
        value = json.loads(text)
        cluster = value["cluster"]
        task_type = value["task"]["type"]
        task_id = int(value["task"]["index"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"TF_CONFIG is not a valid cluster spec: {error}") from error
    num_workers = len(cluster.get("worker", [])) + len(cluster.get("chief", []))
    if task_type not in cluster or task_id >= len(cluster[task_type]):
        raise ValueError(f"TF_CONFIG task {task_type}:{task_id} is not in its cluster")
    is_chief = task_type == "chief" or (task_type == "worker" and task_id == 0 and "chief" not in cluster)
    return ClusterTask(task_type=task_type, task_id=task_id, num_workers=num_workers, is_chief=is_chief, spec=cluster)


def resolve_gpu_ids(gpus: int | list[int], available: int) -> list[int]:
    """The physical GPU ids a request means, or ValueError when they do not exist."""
    if isinstance(gpus, list):
        missing = [index for index in gpus if index >= available]
        if missing:
            raise ValueError(
                f"gpus {gpus} requested but this machine has {available} GPU(s): ids {missing} do not exist"
            )
        return list(gpus)
    if gpus > available:
        raise ValueError(f"gpus={gpus} requested but this machine has {available} GPU(s)")
    return list(range(gpus))


def plan_devices(train: TrainConfig, *, tf_config: str | None = None) -> DevicePlan:
    """Validates the device request and the batch split; raises ValueError before any work."""
    cluster = cluster_task(tf_config)
    available = len(tf.config.list_physical_devices("GPU"))
    gpu_ids = resolve_gpu_ids(train.gpus, available)
    if gpu_ids:
        plan = DevicePlan("GPU", tuple(f"/gpu:{index}" for index in gpu_ids), tuple(gpu_ids), cluster)
    else:
        # The configured logical CPUs, read without initializing the runtime (GPU settings such
        # as memory growth can still be changed after planning). A cluster worker uses one; a process
        # that split its CPU into logical devices (as the tests do) gets a MirroredStrategy over them.
        virtual = tf.config.get_logical_device_configuration(tf.config.list_physical_devices("CPU")[0])
        count = 1 if cluster is not None else max(1, len(virtual or []))
        names = tuple(f"/cpu:{index}" for index in range(count))
        plan = DevicePlan("CPU", names, (), cluster)
    # Without a cluster yet, `train.workers` processes will join one (cifar.cluster): the same rule applies.
    workers = plan.num_workers if cluster is not None else train.workers
    if train.batch_size % (len(plan.devices) * workers):
        raise ValueError(
            f"batch_size {train.batch_size} is the global batch and must be divisible by the "
            f"{len(plan.devices) * workers} replicas ({len(plan.devices)} x {plan.device_type} on each of {workers} "
            "worker(s))"
        )
    return plan


def create_strategy(plan: DevicePlan) -> tf.distribute.Strategy:
    """The strategy for a plan: one device, Mirrored over local devices, or MultiWorkerMirrored."""
    compat.patch_device_prefetch_autotune()  # No idle minute after the last epoch (see there).
    strategy = _strategy(plan)
    # After the strategy: the undo runs a TF op, and a multi-worker strategy must be made before any op runs.
    compat.undo_generator_malloc_patch()  # Freed tensor memory reused, not mapped afresh each step (see there).
    return strategy


def _strategy(plan: DevicePlan) -> tf.distribute.Strategy:
    if plan.cluster is not None:
        # Hide unselected GPUs: the multi-worker strategy uses every visible device.
        physical = tf.config.list_physical_devices("GPU")
        if physical:
            try:
                tf.config.set_visible_devices([physical[index] for index in plan.gpu_ids], "GPU")
            except RuntimeError:
                pass  # The runtime is already initialized (e.g. the caller ran TF ops first): keep what is visible.
        compat.patch_multi_worker_reduce()
        # The cluster as planned (from TF_CONFIG or a rendezvous), not the environment read again.
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(plan.cluster.spec),
            task_type=plan.cluster.task_type,
            task_id=plan.cluster.task_id,
            rpc_layer="grpc",
            num_accelerators={"GPU": len(plan.gpu_ids)} if plan.gpu_ids else None,
        )
        return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    if len(plan.devices) == 1:
        return tf.distribute.OneDeviceStrategy(plan.devices[0])
    return tf.distribute.MirroredStrategy(devices=list(plan.devices))


def writable_dir(plan: DevicePlan, directory: str | Path) -> Path:
    """The chief writes to `directory`; other workers to a fresh temp dir (delete with `cleanup_dir`).

    Only the chief writes (the task of type `chief`, or `worker` 0 when the cluster has no chief); the
    others take part in every collective, saving included, into directories that are deleted: the
    standard Keras multi-worker pattern.
    """
    if plan.is_chief:
        Path(directory).mkdir(parents=True, exist_ok=True)
        return Path(directory)
    return Path(tempfile.mkdtemp(prefix=f"worker-{plan.cluster.task_id}-"))


def cleanup_dir(plan: DevicePlan, directory: str | Path) -> None:
    """Deletes a non-chief worker's temporary directory; the chief's is kept."""
    if not plan.is_chief:
        shutil.rmtree(directory, ignore_errors=True)


# What TensorFlow raises in a collective when another process of the job is gone (coordination-service heartbeats).
LOST_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.DeadlineExceededError)


def lost_peer(error: tf.errors.OpError, plan: DevicePlan) -> Exception | None:
    """For a multi-worker plan, the one-line `WorkerLostError` naming whom TensorFlow's error names; else None."""
    if plan.cluster is None:
        return None
    from cifar.cluster import lost_worker

    return lost_worker(error.message, plan.cluster.spec.get("worker", []), plan.cluster.task_id)
