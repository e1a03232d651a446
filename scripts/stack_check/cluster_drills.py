"""Drills of one training spread over two worker containers: one of them killed, then the job run again.

They run after the search drill, which leaves two workers, one flow run each (CIFAR_WORKER_LIMIT=1), and
a `training` limit of 2. A job of `train.workers=2` is then the smoke deployment's run (the chief) on one
container and the `cifar-train-worker/worker` run it places on the other: they meet through the Prefect
API and train one MultiWorkerMirroredStrategy model over the compose network. The job run again after the kill
is the drill of a job that trains to the end (one MLflow run, the same loss on both workers): one training
serves both, where a clean job of its own would repeat what the re-run proves.
"""

from __future__ import annotations

import re
import time
from typing import Any

from scripts.stack_check.context import Context
from scripts.stack_check.drills import metric_steps, submitted_flow_runs, wait_for_log_line
from scripts.stack_check.report import Row
from scripts.stack_check.shell import StepError, wait_until
from scripts.stack_check.stack import WORKDIR, Stack, archive_parameters

LOST_RUN = "stack-check-2-workers-lost"
JOB_TAG = "cifar-training-job"  # On the flow runs a chief places (tasks/cluster.py).
# A job must end this soon after one of its workers is killed: TensorFlow's coordination service
# misses the lost worker's heartbeats within 10 s; the rest is the chief reporting its failure.
LOST_WORKER_BOUND_SECONDS = 60
WORKER_EPOCH = re.compile(r"Worker 1: epoch (\d+)/\d+, loss (\d+\.\d+)")


def job_parameters(context: Context, run_name: str, epochs: int, workers: int = 2) -> dict[str, Any]:
    train = {"workers": workers, "epochs": epochs, "run_name": run_name}
    config = {"preset": "smoke", "data": archive_parameters(context.settings.archive), "train": train}
    return {"config": config, "until": "train"}


def job_flow_runs(stack: Stack) -> dict[str, dict]:
    """Every flow run a chief placed for its job, by id."""
    runs = stack.prefect("POST", "/flow_runs/filter", {"flow_runs": {"tags": {"all_": [JOB_TAG]}}})
    return {run["id"]: run for run in runs}


def placed_worker(stack: Stack, known: set[str], timeout: float = 300) -> dict:
    """The job's worker flow run placed since `known` was read."""

    def probe():
        new = [run for run_id, run in job_flow_runs(stack).items() if run_id not in known]
        if len(new) > 1:
            raise StepError(f"{len(new)} worker flow runs placed for one job of 2 workers")
        return new[0] if new else None

    return wait_until("the chief's worker flow run", probe, timeout, interval=2)


def container_of(stack: Stack, flow_run_id: str, timeout: float = 300) -> str:
    """The worker container that took a flow run (its log names the runs it submitted)."""

    def probe():
        ran_in = [name for name in stack.containers("worker") if flow_run_id in submitted_flow_runs(stack.logs(name))]
        return ran_in[0] if len(ran_in) == 1 else None

    return wait_until(f"the container running flow run {flow_run_id}", probe, timeout, interval=2)


def mlflow_run_of(stack: Stack, run_name: str) -> str:
    state = stack.read_json("worker", f"{WORKDIR}/runs/{run_name}/state.json") or {}
    if not state.get("mlflow_run_id"):
        raise StepError(f"runs/{run_name}/state.json names no MLflow run")
    return state["mlflow_run_id"]


def runs_started_since(stack: Stack, experiment_id: str, since_ms: int) -> list[dict]:
    url = f"{stack.mlflow_url}/api/2.0/mlflow/runs/search"
    body = {"experiment_ids": [experiment_id], "filter": f"attributes.start_time >= {since_ms}", "max_results": 50}
    return stack.http("POST", url, body, auth=stack.credentials("mlflow-admin")).get("runs", [])


def worker_scratch(stack: Stack, container: str) -> set[str]:
    """A job worker's scratch directories in a container's /tmp (cifar/distribute.py makes one per training)."""
    found = stack.engine("exec", container, "find", "/tmp", "-maxdepth", "1", "-name", "worker-1-*", timeout=60)
    return set(found.stdout.split())


def check_lost_worker(context: Context, row: Row) -> None:
    """A 4-epoch job; after the chief's first checkpoint the worker's container is killed (SIGKILL).

    The chief fails at once, and the job can run again at once: its worker's flow run, whose heartbeats
    stopped, is marked CRASHED by the automation while the re-run trains (check_lost_worker_resume waits).
    """
    stack, findings = context.stack, context.findings
    findings.lost_since_ms, known = int(time.time() * 1000), set(job_flow_runs(stack))
    chief_id = stack.deployment_run("cifar/smoke", job_parameters(context, LOST_RUN, 4), watch=False)
    worker = placed_worker(stack, known)
    stack.wait_flow_run(worker["id"], {"RUNNING"}, timeout=300)
    container = container_of(stack, worker["id"])

    def first_checkpoint():
        index = stack.read_json("worker", f"{WORKDIR}/runs/{LOST_RUN}/checkpoints/index.json")
        return index if index and index.get("entries") else None

    wait_until("the job's first checkpoint", first_checkpoint, timeout=600, interval=1)
    stack.engine("kill", container, timeout=60)
    killed_at = time.monotonic()
    chief = stack.wait_flow_run(chief_id, {"FAILED", "CRASHED"}, timeout=LOST_WORKER_BOUND_SECONDS + 60)
    ended_after = time.monotonic() - killed_at
    if ended_after > LOST_WORKER_BOUND_SECONDS:
        raise StepError(
            f"the chief ended {ended_after:.0f} s after its worker was killed (bound {LOST_WORKER_BOUND_SECONDS} s)"
        )
    if stack.state(container) != "running":  # restart: unless-stopped may already have started it again.
        stack.engine("start", container, timeout=120)
    stack.wait_healthy(["worker"], 600)
    index = stack.read_json("worker", f"{WORKDIR}/runs/{LOST_RUN}/checkpoints/index.json")
    findings.lost_last_epoch = max(entry["epoch"] for entry in index["entries"])
    findings.lost_mlflow_run, findings.lost_worker_run = mlflow_run_of(stack, LOST_RUN), worker["id"]
    if findings.lost_last_epoch >= 4:
        raise StepError("training had finished before the kill: nothing to resume")
    message = (chief["state"].get("message") or "").removeprefix("Flow run encountered an exception: ")
    message = message.split(" (TensorFlow")[0]
    row.detail = (
        f"worker container killed after epoch {findings.lost_last_epoch}/4: chief {chief['state']['type']} "
        f"{ended_after:.0f} s later ({message})"
    )


def check_lost_worker_resume(context: Context, row: Row) -> None:
    """The job run again: a chief and a worker in the two containers train one model, one MLflow run."""
    stack, findings, started = context.stack, context.findings, time.monotonic()
    scratch_before = {name: worker_scratch(stack, name) for name in stack.containers("worker")}
    known = set(job_flow_runs(stack))
    chief_id = stack.deployment_run("cifar/smoke", job_parameters(context, LOST_RUN, 4), watch=True, timeout=1200)
    chief = stack.wait_flow_run(chief_id, {"COMPLETED"}, timeout=120)
    worker = placed_worker(stack, known, timeout=30)
    worker = stack.wait_flow_run(worker["id"], {"COMPLETED"}, timeout=120)
    lost = stack.wait_flow_run(findings.lost_worker_run, {"CRASHED", "FAILED"}, timeout=300)  # Heartbeats stopped.
    wanted = f"resuming {LOST_RUN} after epoch {findings.lost_last_epoch}"
    wait_for_log_line(stack, chief_id, wanted, timeout=60)
    chief_container, worker_container = container_of(stack, chief_id), container_of(stack, worker["id"])
    if chief_container == worker_container:
        raise StepError(f"the chief and its worker both ran in {chief_container}")
    run_id = mlflow_run_of(stack, LOST_RUN)
    if run_id != findings.lost_mlflow_run:
        raise StepError("the re-run opened a new MLflow run instead of continuing the job's")
    experiment = stack.mlflow("runs/get", run_id=run_id)["run"]["info"]["experiment_id"]
    opened = runs_started_since(stack, experiment, findings.lost_since_ms)
    if [run["info"]["run_id"] for run in opened] != [run_id]:
        raise StepError(f"MLflow runs opened by the job: {[run['info']['run_name'] for run in opened]}, not one")
    chief_losses = metric_steps(stack, run_id, "loss")
    worker_losses = {int(epoch): float(loss) for epoch, loss in WORKER_EPOCH.findall("\n".join(
        stack.flow_run_logs(worker["id"])))}  # fmt: skip
    resumed = list(range(findings.lost_last_epoch + 1, 5))
    if sorted(chief_losses) != [1, 2, 3, 4] or sorted(worker_losses) != resumed:
        logged = f"chief (MLflow) {sorted(chief_losses)}, the re-run's worker {sorted(worker_losses)}"
        raise StepError(f"epochs logged: {logged}")
    differing = {epoch: (chief_losses[epoch], worker_losses[epoch]) for epoch in resumed
                 if abs(chief_losses[epoch] - worker_losses[epoch]) > 1e-3}  # fmt: skip
    if differing:
        raise StepError(f"the workers' losses differ (chief, worker) by epoch: {differing}")
    index = stack.read_json("worker", f"{WORKDIR}/runs/{LOST_RUN}/checkpoints/index.json") or {}
    saved = sorted(entry["epoch"] for entry in index.get("entries", []))
    left = worker_scratch(stack, worker_container) - scratch_before.get(worker_container, set())
    if not saved or saved[-1] != 4 or left:
        raise StepError(f"the chief's checkpoints: epochs {saved}; the worker's scratch left: {sorted(left)}")
    project = len(stack.project) + 1
    losses = ", ".join(f"{chief_losses[epoch]:.4f}" for epoch in resumed)
    row.detail = (
        f"the killed worker's flow run {lost['state']['type']} (heartbeats stopped); chief {chief['name']} in "
        f"{chief_container[project:]}, worker in {worker_container[project:]}, both COMPLETED in "
        f"{time.monotonic() - started:.0f} s: '{wanted}', epochs {resumed[0]}-4 trained, loss {losses} on both "
        f"workers (±1e-3); one MLflow run, loss steps 1-4 once each; checkpoints only in the chief's run folder "
        f"(epochs {saved}), the worker's scratch deleted"
    )
