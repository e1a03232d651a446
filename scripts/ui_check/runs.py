"""The runs the UIs are checked on: `cifar/smoke` on the real archive, `cifar-sweep/sweep`, a challenger, and one
waiting for a person's approval."""

from __future__ import annotations

import json
import time
from pathlib import Path

from scripts.stack_check.context import TOLERANT_GATE
from scripts.ui_check.stack import Stack, StackError, worker_alive

RUN_TIMEOUT_S = 480  # For both runs together (they start at once; the `training` limit serialises training).
SWEEP_LEARNING_RATES = [0.02, 0.05]
FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def deployment(stack: Stack, name: str) -> dict:
    return stack.call("GET", f"{stack.api}/deployments/name/{name}")  # type: ignore[return-value]


def run_deployment(stack: Stack, name: str, parameters: dict) -> str:
    """A flow run of deployment `name` (its parameters merged over the deployment's); returns its id."""
    flow_run = stack.call(
        "POST", f"{stack.api}/deployments/{deployment(stack, name)['id']}/create_flow_run", {"parameters": parameters}
    )
    return flow_run["id"]  # type: ignore[index]


def wait_runs(stack: Stack, flow_run_ids: dict[str, str], until: set[str] = FINAL_STATES) -> dict[str, dict]:
    """Waits until every flow run is in a state of `until` (terminal); StackError when one did not complete
    (or pause, when `until` has PAUSED)."""
    deadline, done = time.monotonic() + RUN_TIMEOUT_S, {}
    shown: dict[str, str] = {}
    while len(done) < len(flow_run_ids):
        for label, run_id in flow_run_ids.items():
            if label in done:
                continue
            flow_run = stack.call("GET", f"{stack.api}/flow_runs/{run_id}")
            state = flow_run["state"]["name"]  # type: ignore[index]
            if shown.get(label) != state:
                print(f"  {time.strftime('%H:%M:%S')} {label}: {state}", flush=True)
                shown[label] = state
            if flow_run["state"]["type"] in until:  # type: ignore[index]
                done[label] = flow_run
        worker_alive(stack)
        if time.monotonic() > deadline:
            raise StackError(f"runs not finished after {RUN_TIMEOUT_S}s: {shown}")
        time.sleep(2)
    wanted = {"COMPLETED"} | (until - FINAL_STATES)
    failed = {label: run["state"] for label, run in done.items() if run["state"]["type"] not in wanted}
    if failed:
        raise StackError(f"runs did not complete: {json.dumps(failed, indent=1)[:3000]}")
    return done


def run_pipelines(stack: Stack, archive: Path, sha256: str) -> dict[str, dict]:
    """The three runs, tracked on the stack's MLflow server; their flow runs by label once all completed."""
    workdir = stack.tmp / "workdir"
    config = {
        "preset": "smoke",
        "data": {"source": str(archive), "sha256": sha256},
        "tracking": {"tracking_uri": stack.mlflow_url},
    }
    smoke = run_deployment(stack, "cifar/smoke", {"config": config, "workdir": str(workdir)})
    sweep = run_deployment(
        stack,
        "cifar-sweep/sweep",
        {"config": config, "models": ["tiny"], "learning_rates": SWEEP_LEARNING_RATES, "workdir": str(workdir)},
    )
    runs = wait_runs(stack, {"cifar/smoke": smoke, "cifar-sweep/sweep": sweep})
    # A challenger (another seed: another model) that the gate compares with the smoke run's champion.
    challenger = run_deployment(stack, "cifar/smoke", {"config": {**config, "seed": 1}, "workdir": str(workdir)})
    runs |= wait_runs(stack, {"challenger": challenger})
    # A third model, waiting for a person's approval (its form), past a gate any challenger passes: with
    # `significance` 1e-12 a seed 8.4 points worse was refused (p = 1.8e-37, 2026-11-29) and never waited.
    waiting = {**config, "seed": 2, "promotion": {"approval": "required"}, "export": TOLERANT_GATE}
    return runs | wait_runs(stack, {"waiting": run_deployment(stack, "cifar/smoke", {"config": waiting,
                                                                                    "workdir": str(workdir)})},
                            until=FINAL_STATES | {"PAUSED"})  # fmt: skip
