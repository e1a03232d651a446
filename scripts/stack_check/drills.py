"""Drills on the running stack: a worker killed mid-training, then stopped (SIGTERM) in the re-run that resumes, and
the re-run after that; two workers sharing a search."""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from scripts.stack_check.context import Context
from scripts.stack_check.report import Row
from scripts.stack_check.shell import StepError, wait_until
from scripts.stack_check.stack import FINAL_STATES, WORKDIR, Stack, archive_parameters

KILL_RUN_NAME = "stack-check-kill"
KILL_RUN_DIR = f"{WORKDIR}/runs/{KILL_RUN_NAME}"
STOP_TIMEOUT_SECONDS = 120  # `podman stop -t`: compose's stop_grace_period for the workers.


def kill_parameters(archive: Path) -> dict[str, Any]:
    config = {"preset": "smoke", "data": archive_parameters(archive), "train": {"epochs": 4, "run_name": KILL_RUN_NAME}}
    return {"config": config, "until": "train"}


def check_kill(context: Context, row: Row) -> None:
    stack = context.stack
    flow_run_id = stack.deployment_run("cifar/smoke", kill_parameters(context.settings.archive), watch=False)
    stack.wait_flow_run(flow_run_id, {"RUNNING"}, timeout=300)

    def first_checkpoint():
        index = stack.read_json("worker", f"{KILL_RUN_DIR}/checkpoints/index.json")
        return index if index and index.get("entries") else None

    wait_until("the first checkpoint of the drill", first_checkpoint, timeout=600, interval=1)
    state_before = stack.read_json("worker", f"{KILL_RUN_DIR}/state.json") or {}
    worker = stack.container("worker")
    stack.engine("kill", worker, timeout=60)  # SIGKILL: the worker and its flow run's process die at once.
    killed_at = time.monotonic()
    if stack.state(worker) != "running":  # restart: unless-stopped may already have started it again.
        stack.engine("start", worker, timeout=120)
    stack.wait_healthy(["worker"], 600)
    stack.pause_nightly()
    index = stack.read_json("worker", f"{KILL_RUN_DIR}/checkpoints/index.json")
    last_epoch = max(item["epoch"] for item in index["entries"])
    if last_epoch >= 3:  # The re-run trains an epoch, then is stopped in the last (check_resume_then_stop).
        raise StepError(f"training was at epoch {last_epoch} of 4 when killed: too late for the drills that follow")
    run = stack.wait_flow_run(flow_run_id, {"CRASHED"}, timeout=420)
    crashed_after = time.monotonic() - killed_at
    context.findings.kill_last_epoch, context.findings.kill_mlflow_run = last_epoch, state_before.get("mlflow_run_id")
    row.detail = (
        f"container killed after epoch {last_epoch} of 4 was checkpointed; flow run {run['name']} CRASHED "
        f"{crashed_after:.0f} s later ({run['state'].get('message')})"
    )


def check_resume_then_stop(context: Context, row: Row) -> None:
    """The re-run continues the killed training; one epoch later its container is stopped politely (SIGTERM).

    One training serves both drills: the resume after a kill, and a stop that saves mid-epoch and ends the
    flow run by itself before `stop`'s grace period runs out.
    """
    stack, findings = context.stack, context.findings
    flow_run_id = stack.deployment_run("cifar/smoke", kill_parameters(context.settings.archive), watch=False)
    stack.wait_flow_run(flow_run_id, {"RUNNING"}, timeout=300)
    wanted = f"resuming {KILL_RUN_NAME} after epoch {findings.kill_last_epoch}"
    wait_for_log_line(stack, flow_run_id, wanted, timeout=300)

    def trained_one_more():  # Stopped in an epoch after the first it trained: the stop lands mid-epoch.
        history = stack.read_json("worker", f"{KILL_RUN_DIR}/history.json") or {}
        return len(history.get("epoch", [])) > findings.kill_last_epoch

    wait_until("an epoch trained by the re-run", trained_one_more, timeout=600, interval=1)
    container = stack.container("worker")
    stopping = time.monotonic()
    stack.engine("stop", "-t", str(STOP_TIMEOUT_SECONDS), container, timeout=STOP_TIMEOUT_SECONDS + 60)
    stopped_after = time.monotonic() - stopping
    run = stack.flow_run(flow_run_id)
    message = run["state"].get("message") or ""
    saved = re.search(r"saved after step (\d+) of (\d+) in epoch (\d+)", message)
    if run["state"]["type"] not in FINAL_STATES - {"COMPLETED"} or not saved:
        raise StepError(f"after `stop` the flow run is {run['state']['type']}: {message[:300]}")
    exit_code = stack.engine("inspect", "--format", "{{.State.ExitCode}}", container, timeout=60).stdout.strip()
    if stopped_after >= STOP_TIMEOUT_SECONDS or exit_code == "137":
        raise StepError(f"the container did not stop by itself within {STOP_TIMEOUT_SECONDS} s (exit {exit_code})")
    findings.stop_step, steps, findings.stop_epoch = (int(value) for value in saved.groups())
    stack.engine("start", container, timeout=120)
    stack.wait_healthy_containers([container], 600)
    stack.pause_nightly()
    row.detail = (
        f"re-run logged '{wanted}'; `{stack.engine.name} stop` during epoch {findings.stop_epoch}: saved after "
        f"step {findings.stop_step} of {steps}, flow run {run['state']['type']}, container exited {exit_code} in "
        f"{stopped_after:.0f} s"
    )


def check_resume_after_stop(context: Context, row: Row) -> None:
    stack, findings = context.stack, context.findings
    flow_run_id = stack.deployment_run("cifar/smoke", kill_parameters(context.settings.archive), watch=True)
    stack.wait_flow_run(flow_run_id, {"COMPLETED"}, timeout=120)
    wanted = f"resuming {KILL_RUN_NAME} after step {findings.stop_step} of epoch {findings.stop_epoch}"
    wait_for_log_line(stack, flow_run_id, wanted, timeout=60)
    history = stack.read_json("worker", f"{KILL_RUN_DIR}/history.json") or {}
    state = stack.read_json("worker", f"{KILL_RUN_DIR}/state.json") or {}
    if history.get("epoch") != [1, 2, 3, 4] or state.get("status") != "completed":
        raise StepError(f"history epochs {history.get('epoch')}, state {state.get('status')}")
    if state.get("mlflow_run_id") != findings.kill_mlflow_run:
        raise StepError("a re-run opened a new MLflow run instead of continuing the killed one")
    losses = metric_steps(stack, findings.kill_mlflow_run, "loss")
    if sorted(losses) != [1, 2, 3, 4]:
        raise StepError(f"MLflow loss steps {sorted(losses)}, not 1-4 once each")
    row.detail = (
        f"the second re-run logged '{wanted}'; after a kill and a stop, history 1-4 once each, MLflow loss steps "
        "1-4 once each, one MLflow run"
    )


def check_search(context: Context, row: Row) -> None:
    """Two workers, one flow run each (CIFAR_WORKER_LIMIT=1); the search runs beside them and spreads its trials.

    The search is started from the command line in a worker container (`python flows/search.py` with the
    container's PREFECT_API_URL: the `cifar-search` flow on the server, trials on its pool). Through the
    `cifar-search/search` deployment the search's own flow run would take a worker: with a limit of 1 that
    worker could run no trial, and without a limit one worker may take both trials.
    """
    stack, started = context.stack, time.monotonic()
    stack.set_variable("CIFAR_WORKER_LIMIT", "1")
    stack.compose("up", "-d", "--scale", "worker=2", "worker")  # Recreates worker 1 with the limit too.
    stack.wait_healthy(["worker"], 600)
    workers = stack.containers("worker")
    if len(workers) != 2:
        raise StepError(f"{len(workers)} worker containers, not 2")
    stack.pause_nightly()
    stack.exec("worker", "prefect", "concurrency-limit", "create", "training", "2", timeout=120)
    source = archive_parameters(context.settings.archive)
    command = ["python", "flows/search.py", "--source", source["source"], "--sha256", source["sha256"]]
    command += ["--preset", "smoke", "--space", "smoke", "--trials", "4", "--parallel", "2", "--until", "train"]
    # The smoke space on the smoke preset with shorter epochs: the point is where and when trials run.
    command += ["--set", "train.steps_per_epoch=20"]
    stack.exec("worker", *command, timeout=1800)
    summaries = [stack.read_json("worker", f"{WORKDIR}/search-summary.json", index=index) for index in (0, 1)]
    if not summaries[0] or summaries[0] != summaries[1]:
        raise StepError("the two workers do not see the same search-summary.json")
    trials = summaries[0]["trials"]
    if len(trials) != 4 or not all(map(finished_as_expected, trials)):
        raise StepError(f"trials: {[(trial['number'], trial['state'], trial['failure']) for trial in trials]}")
    searches = stack.prefect("POST", "/flow_runs/filter", {"flows": {"name": {"any_": ["cifar-search"]}}})
    if [run["state"]["type"] for run in searches] != ["COMPLETED"]:
        raise StepError(f"cifar-search flow runs: {[run['state']['type'] for run in searches]}")
    spans = trial_spans(stack, workers, trials)
    if {container for container, *_ in spans} != set(workers):
        raise StepError(f"all trials ran in {spans[0][0]}")
    overlaps = [
        f"#{a[3]}+#{b[3]}"
        for position, a in enumerate(spans)
        for b in spans[position + 1 :]
        if a[0] != b[0] and a[1] < b[2] and b[1] < a[2]
    ]
    if not overlaps:
        raise StepError("no two trials ran at the same time in different containers")
    placement = ", ".join(f"#{number} {container[len(stack.project) + 1 :]}" for container, _, _, number in spans)
    row.detail = (
        f"cifar-search COMPLETED in {time.monotonic() - started:.0f} s, {summaries[0]['counts']}; trials "
        f"{placement}; in both containers at once: {', '.join(overlaps)}; one study journal and "
        f"search-summary.json on the shared workdir volume"
    )


def finished_as_expected(trial: dict) -> bool:
    """Completed, pruned, or failed because its sampled learning rate diverged.

    The smoke space reaches 0.3 on purpose (see cifar/search/space.py), and which trial draws what depends on
    which of the parallel trials ends first, so a diverged trial is the search working, not the drill failing:
    a FAIL for any other reason (a lost run, a crash) still fails the step.
    """
    if trial["state"] in ("COMPLETE", "PRUNED"):
        return True
    return trial["state"] == "FAIL" and "TrainingDivergedError" in (trial.get("failure") or "")


def trial_spans(stack: Stack, workers: list[str], trials: list[dict]) -> list[tuple[str, datetime, datetime, int]]:
    """(container, start, end, trial number) of each trial's flow run.

    Which container ran which trial: each worker's own log names the flow runs it submitted. Both workers may
    try the same run; the server lets one have it and the other logs "Aborted submission".
    """
    submitted = {name: submitted_flow_runs(stack.logs(name)) for name in workers}
    spans = []
    for trial in trials:
        run = stack.flow_run(trial["flow_run_id"])
        ran_in = [name for name in workers if trial["flow_run_id"] in submitted[name]]
        if len(ran_in) != 1:
            raise StepError(f"trial {trial['number']} was submitted by {ran_in or 'no worker'}")
        spans.append((ran_in[0], parse_time(run["start_time"]), parse_time(run["end_time"]), trial["number"]))
    return spans


def wait_for_log_line(stack: Stack, flow_run_id: str, wanted: str, timeout: float) -> None:
    """Until a line of the flow run's logs contains `wanted` (StepError after `timeout`)."""

    def logged():
        return any(wanted in line for line in stack.flow_run_logs(flow_run_id))

    wait_until(f"the log line '{wanted}'", logged, timeout, interval=1)


def metric_steps(stack: Stack, run_id: str, key: str) -> dict[int, float]:
    """step -> value of one metric; StepError if a step was logged twice."""
    history = stack.mlflow("metrics/get-history", run_id=run_id, metric_key=key).get("metrics", [])
    steps = [entry["step"] for entry in history]
    if len(steps) != len(set(steps)):
        raise StepError(f"MLflow run {run_id} has {key} logged twice at steps {sorted(steps)}")
    return {entry["step"]: entry["value"] for entry in history}


def submitted_flow_runs(worker_log: str) -> set[str]:
    """The flow runs a worker submitted: those it tried, less those the server gave another worker."""
    tried = set(re.findall(r"submitting flow run '([0-9a-f-]{36})'", worker_log))
    return tried - set(re.findall(r"Aborted submission of flow run '([0-9a-f-]{36})'", worker_log))


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))
