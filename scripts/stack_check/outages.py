"""The stack's own outages: PostgreSQL, the Prefect server and the MLflow server each restarted while a training
runs through the stack; it finishes COMPLETED with every epoch in MLflow once, and no one lends a hand."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from scripts.stack_check.context import Context
from scripts.stack_check.report import Row
from scripts.stack_check.shell import StepError, wait_until
from scripts.stack_check.stack import FINAL_STATES, WORKDIR, Stack, archive_parameters

OUTAGE_RUN_NAME = "stack-check-outages"
OUTAGE_RUN_DIR = f"{WORKDIR}/runs/{OUTAGE_RUN_NAME}"
OUTAGE_EPOCHS = 8  # Smoke epochs (10-30 s each here): the restarts, ~35 s from the first to the third, fit twice over.
RESTARTED = ("postgres", "prefect-server", "mlflow")


def outage_parameters(archive: Path) -> dict[str, Any]:
    train = {"epochs": OUTAGE_EPOCHS, "run_name": OUTAGE_RUN_NAME}
    return {"config": {"preset": "smoke", "data": archive_parameters(archive), "train": train}, "until": "train"}


def checkpointed_epoch(stack: Stack) -> int:
    index = stack.read_json("worker", f"{OUTAGE_RUN_DIR}/checkpoints/index.json") or {}
    return max((entry["epoch"] for entry in index.get("entries", [])), default=0)


def restart_mid_training(stack: Stack, service: str, flow_run_id: str) -> str:
    """`restart` of the service's container while the flow run trains; when it was and how long it took."""
    epoch, state = checkpointed_epoch(stack), stack.flow_run(flow_run_id)["state"]["type"]
    if epoch >= OUTAGE_EPOCHS or state in FINAL_STATES:
        raise StepError(f"the training was over ({state}, epoch {epoch}) before {service} could be restarted")
    started = time.monotonic()
    stack.engine("restart", "--time", "10", stack.container(service), timeout=180)
    stack.wait_healthy([service], 300)
    # Healthy is not yet serving: after PostgreSQL's restart the Prefect server answers 500 until its
    # connections are made again (a name lookup of `postgres` can stall for seconds while the network
    # re-registers it). The restart is over when the API reads the flow run again.
    wait_until(f"the Prefect API after {service}'s restart", lambda: api_reads(stack, flow_run_id), 180, 2)
    return f"{service} after epoch {epoch} ({time.monotonic() - started:.0f} s)"


def api_reads(stack: Stack, flow_run_id: str) -> bool:
    try:
        return bool(stack.flow_run(flow_run_id))
    except StepError:
        return False


def epochs_in_mlflow(stack: Stack, run_id: str, keys: list[str]) -> dict[str, list[int]]:
    """Each metric's logged steps, as MLflow's history has them (a repeat would show twice)."""
    return {
        key: sorted(
            point["step"] for point in stack.mlflow("metrics/get-history", run_id=run_id, metric_key=key)["metrics"]
        )
        for key in keys
    }


def check_outages(context: Context, row: Row) -> None:
    stack, started = context.stack, time.monotonic()
    flow_run_id = stack.deployment_run("cifar/smoke", outage_parameters(context.settings.archive), watch=False)
    stack.wait_flow_run(flow_run_id, {"RUNNING"}, timeout=300)
    wait_until("the outage drill's first epoch", lambda: checkpointed_epoch(stack) >= 1, timeout=600, interval=1)
    restarts = [restart_mid_training(stack, service, flow_run_id) for service in RESTARTED]
    run = stack.wait_flow_run(flow_run_id, {"COMPLETED"}, timeout=1200)
    history = stack.read_json("worker", f"{OUTAGE_RUN_DIR}/history.json") or {}
    state = stack.read_json("worker", f"{OUTAGE_RUN_DIR}/state.json") or {}
    epochs = list(range(1, OUTAGE_EPOCHS + 1))
    if history.get("epoch") != epochs or state.get("status") != "completed":
        raise StepError(f"history epochs {history.get('epoch')}, state {state.get('status')}")
    keys = sorted(key for key in history if key != "epoch")
    logged = epochs_in_mlflow(stack, state["mlflow_run_id"], keys)
    wrong = {key: steps for key, steps in logged.items() if steps != epochs}
    if wrong or "loss" not in logged:
        raise StepError(f"MLflow's epochs are not 1-{OUTAGE_EPOCHS} once each: {wrong}")
    row.detail = (
        f"{OUTAGE_EPOCHS}-epoch smoke training; restarted {', '.join(restarts)}; flow run {run['name']} COMPLETED, "
        f"{len(keys)} metrics at epochs 1-{OUTAGE_EPOCHS} once each in MLflow, no hand needed "
        f"({time.monotonic() - started:.0f} s)"
    )
