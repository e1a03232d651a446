"""One training across N processes: what they tell each other to start together, and the checkpoint they start from.

Each process joins through a `Rendezvous` (the orchestrator's side: `tasks/cluster.py` over the Prefect API):
it reports a `WorkerAddress` (its reachable host:port and a digest of its shards); the chief, once all
have joined, hands every one the same `ClusterSpec` (the TF cluster, where the chief's run stands, or why
the job cannot start). No shared directory: a checkpoint to resume from travels as an MLflow artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict

from cifar.checkpoints import CheckpointIndex, PartialEpoch, RunDirectory
from cifar.data.manifest import Manifest
from cifar.io import file_digest

HOST_ENV = "CIFAR_WORKER_HOST"  # The address other workers reach this one at (a pod IP, a DNS name).
PORT_ENV = "CIFAR_WORKER_PORT"  # The port its TF server listens on (a container's published port).
POLL_SECONDS = 1.0
RESUME_ARTIFACT_DIR = "resume"  # In the chief's MLflow run: the checkpoint a resumed job starts from.

Value = TypeVar("Value")


class WorkerAddress(BaseModel):
    """What a process reports when it joins a job."""

    model_config = ConfigDict(extra="forbid")
    index: int  # 0 is the chief.
    address: str  # host:port its TensorFlow server listens on.
    hostname: str
    flow_run: str  # Its flow run's name, or another label a person recognises.
    data_digest: str  # Of its shards (`data_digest`): every worker must read the same bytes.


class ResumePoint(BaseModel):
    """Where the chief's run stands when the job starts; every worker starts there."""

    model_config = ConfigDict(extra="forbid")
    epoch: int = 0  # Committed epochs.
    partial: PartialEpoch | None = None  # A stop mid-epoch (SIGTERM) after `epoch`.
    checkpoint: str | None = None  # Artifact path of the model file in the chief's MLflow run.
    sha256: str | None = None
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None


class ClusterSpec(BaseModel):
    """What the chief hands every worker: the cluster and the start point, or why the job cannot start."""

    model_config = ConfigDict(extra="forbid")
    job: str
    workers: list[str] = []  # host:port by index.
    resume: ResumePoint = ResumePoint()
    failure: str | None = None

    def tf_config(self, index: int) -> str:
        """TF_CONFIG of worker `index` (worker 0 is the chief, as cifar.distribute reads it)."""
        return json.dumps({"cluster": {"worker": self.workers}, "task": {"type": "worker", "index": index}})


class GangStartError(RuntimeError):
    """The job's processes did not all join in time (or cannot train together); the message names who."""


class WorkerLostError(RuntimeError):
    """A process of a running job died or became unreachable; every other one stopped (TF's coordination service)."""


def lost_worker(error: str, workers: list[str], me: int) -> WorkerLostError:
    """One line for TensorFlow's error when a collective of the job failed, naming the processes it names."""
    named = sorted({int(index) for index in re.findall(r"/job:worker/(?:replica:0/)?task:(\d+)", error)} - {me})
    who = ", ".join(
        f"{'the chief' if index == 0 else f'worker {index}'} ({workers[index] if index < len(workers) else '?'})"
        for index in named
    )
    text = re.sub(r"\{\{function_node[^}]*\}\}\s*", "", error).strip()  # The failed op's name: noise here.
    first_line = text.splitlines()[0][:200] if text else "no message"
    return WorkerLostError(
        f"training job lost {who or 'a worker'}: every worker stopped (TensorFlow: {first_line}); run the same "
        "command again to resume all workers from the chief's last checkpoint"
    )


class Rendezvous(Protocol):
    """How a process of a job finds the others (implemented over the Prefect API by tasks/cluster.py)."""

    index: int  # 0 is the chief.
    workers: int

    def join(self, data_digest: str, resume: ResumePoint | None) -> ClusterSpec:
        """Reports this process and returns the job's cluster (the chief passes `resume`); GangStartError if not."""
        ...


def data_digest(manifest: Manifest) -> str:
    """One digest of every shard's SHA-256: equal on two machines exactly when they read the same bytes."""
    shards = sorted((name, shard.path, shard.sha256) for name, part in manifest.splits.items() for shard in part.shards)
    return hashlib.sha256(json.dumps(shards).encode()).hexdigest()


def reachable_host(towards: str | None) -> str:
    """The address other machines reach this one at: CIFAR_WORKER_HOST, else this machine's address on the
    route to `towards` (the Prefect API every worker talks to), else its hostname's."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    host = urlparse(towards).hostname if towards else None
    if host:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((host, 9))  # UDP: picks the route, sends nothing.
                return probe.getsockname()[0]
            except OSError:
                pass
    return socket.gethostbyname(socket.gethostname())


def reserve_port() -> int:
    """CIFAR_WORKER_PORT, else a port free now (TensorFlow's server binds it once the job starts)."""
    if os.environ.get(PORT_ENV):
        return int(os.environ[PORT_ENV])
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def wait_for(read: Callable[[], Value | None], timeout: float, waiting_for: Callable[[], str]) -> Value:
    """`read()` until it answers, at most `timeout` seconds; then GangStartError with `waiting_for()`."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise GangStartError(f"{waiting_for()} within {timeout:g} s (train.gang_timeout_seconds)")
        time.sleep(POLL_SECONDS)


def mismatched_data(chief: str, addresses: list[WorkerAddress]) -> str | None:
    """Why the job cannot train (workers whose shards differ from the chief's), or None."""
    different = [address for address in addresses if address.data_digest != chief]
    if not different:
        return None
    names = ", ".join(f"worker {address.index} ({address.flow_run} on {address.hostname})" for address in different)
    return (
        f"{names} prepared shards that differ from the chief's (digest {chief[:12]}): every worker must convert "
        "the same archive with the same settings and code (a snapshot with additions needs the same data store)"
    )


def resume_point(run: RunDirectory, index: CheckpointIndex, tracking_uri: str) -> ResumePoint:
    """The chief's start point, its checkpoint uploaded to its MLflow run for workers without its disk."""
    partial, latest = index.partial, index.latest
    name = partial.model_path if partial else latest.model_path if latest else None
    point = ResumePoint(epoch=latest.epoch if latest else 0, partial=partial)
    run_id = run.read_state().get("mlflow_run_id")
    if name is None or run_id is None:
        return point
    from cifar import tracking

    path = run.checkpoint_dir / name
    tracking.mlflow_client(tracking_uri).log_artifact(run_id, str(path), RESUME_ARTIFACT_DIR)
    uploaded = {"checkpoint": f"{RESUME_ARTIFACT_DIR}/{name}", "sha256": file_digest(path)}
    return point.model_copy(update={**uploaded, "mlflow_run_id": run_id, "tracking_uri": tracking_uri})


def fetch_checkpoint(resume: ResumePoint) -> Path | None:
    """A worker's copy of the chief's checkpoint (checked against its SHA-256), in a temp dir; None from scratch."""
    if resume.checkpoint is None:
        return None
    from cifar import tracking

    directory = Path(tempfile.mkdtemp(prefix="cifar-resume-"))
    client = tracking.mlflow_client(resume.tracking_uri)
    path = Path(client.download_artifacts(resume.mlflow_run_id, resume.checkpoint, str(directory)))
    if file_digest(path) != resume.sha256:
        shutil.rmtree(directory, ignore_errors=True)
        raise GangStartError(f"the chief's checkpoint {resume.checkpoint} arrived damaged (SHA-256 differs)")
    return path
