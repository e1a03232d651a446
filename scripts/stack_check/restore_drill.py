"""The restore drill: `make backup`'s code on the running stack, every volume deleted, `make restore`'s code, and
the runs, metrics, registry, alias, deployments, schedules and the served champion's answers are all back."""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

from scripts.backup.operations import back_up, restore
from scripts.stack_check.context import Context
from scripts.stack_check.pipeline import MODEL_NAME
from scripts.stack_check.report import Row
from scripts.stack_check.serving import first_test_images
from scripts.stack_check.shell import StepError
from scripts.stack_check.stack import FINAL_STATES, Stack
from scripts.stack_check.teardown import leftovers, remove_project

SERVED_IMAGES = 20  # The fixed batch of test images the champion answers before and after.


def mlflow_post(stack: Stack, path: str, body: dict[str, Any]) -> Any:
    return stack.http("POST", f"{stack.mlflow_url}/api/2.0/mlflow/{path}", body, auth=stack.credentials("mlflow-admin"))


def mlflow_state(stack: Stack) -> dict[str, Any]:
    """Experiments, every run with its status, params, tags and each metric's full history, the registry."""
    experiments = stack.mlflow("experiments/search", max_results="1000")["experiments"]
    ids = [experiment["experiment_id"] for experiment in experiments]
    runs = mlflow_post(stack, "runs/search", {"experiment_ids": ids, "max_results": 1000}).get("runs", [])
    state: dict[str, Any] = {"experiments": sorted((e["experiment_id"], e["name"]) for e in experiments), "runs": {}}
    for run in runs:
        info, data = run["info"], run["data"]
        histories = {
            metric["key"]: [
                (point["step"], point["value"], point["timestamp"])
                for point in stack.mlflow("metrics/get-history", run_id=info["run_id"], metric_key=metric["key"])[
                    "metrics"
                ]
            ]
            for metric in data.get("metrics", [])
        }
        state["runs"][info["run_id"]] = {
            "status": info["status"],
            "name": info["run_name"],
            "params": sorted((p["key"], p["value"]) for p in data.get("params", [])),
            "tags": sorted((t["key"], t["value"]) for t in data.get("tags", [])),
            "metrics": histories,
        }
    models = stack.mlflow("registered-models/search", max_results="1000").get("registered_models", [])
    versions = stack.mlflow("model-versions/search", max_results="1000").get("model_versions", [])
    state["models"] = sorted(model["name"] for model in models)
    state["versions"] = sorted(
        (v["name"], v["version"], v["run_id"], v["source"], v["status"], tuple(sorted(v.get("aliases", []))))
        for v in versions
    )
    state["champion"] = stack.mlflow("registered-models/alias", name=MODEL_NAME, alias="champion")["model_version"][
        "version"
    ]
    return state


def prefect_state(stack: Stack) -> dict[str, Any]:
    """Deployments with their schedules and parameters, every finished flow run, automations, pools, limits."""
    deployments = {}
    for deployment in stack.prefect("POST", "/deployments/filter", {}):
        schedules = [
            (json.dumps(item["schedule"], sort_keys=True), item["active"]) for item in deployment.get("schedules", [])
        ]
        deployments[deployment["id"]] = {
            "name": deployment["name"],
            "paused": deployment["paused"],
            "parameters": json.dumps(deployment["parameters"], sort_keys=True),
            "schedules": sorted(schedules),
        }
    runs = stack.prefect(
        "POST", "/flow_runs/filter", {"flow_runs": {"state": {"type": {"any_": sorted(FINAL_STATES)}}}}
    )
    return {
        "deployments": deployments,
        "flow_runs": sorted((run["id"], run["name"], run["state"]["type"]) for run in runs),
        "automations": sorted(item["name"] for item in stack.prefect("POST", "/automations/filter", {})),
        "work_pools": sorted(pool["name"] for pool in stack.prefect("POST", "/work_pools/filter", {})),
        "limits": sorted(
            (limit["tag"], limit["concurrency_limit"])
            for limit in stack.prefect("POST", "/concurrency_limits/filter", {})
        ),
    }


def served_answers(stack: Stack, images: list) -> Any:
    return stack.http("POST", f"{stack.serve_url}/invocations", {"inputs": images}, auth=stack.credentials("serve"))


def differences(before: Any, after: Any, path: str = "") -> list[str]:
    """Where two snapshots differ, as readable paths (a dict's keys; anything else whole)."""
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(before.keys() | after.keys(), key=str):
            if key not in after:
                found.append(f"{path}/{key}: gone")
            elif key not in before:
                found.append(f"{path}/{key}: new")
            else:
                found += differences(before[key], after[key], f"{path}/{key}")
        return found
    return [] if before == after else [f"{path}: {str(before)[:120]} -> {str(after)[:120]}"]


def check_restore(context: Context, row: Row) -> None:
    stack, engine = context.stack, context.engine
    images = first_test_images(context.settings.archive, SERVED_IMAGES)[0].tolist()
    stack.wait_healthy(["serve"], 420)
    before = {"mlflow": mlflow_state(stack), "prefect": prefect_state(stack), "served": served_answers(stack, images)}
    directory, manifest = back_up(stack, context.settings.scratch / "backups")
    remove_project(engine, stack, stack.project)  # `down -v` and anything it missed: every volume is gone.
    if leftovers(engine, stack.project).get("volumes"):
        raise StepError(f"volumes left after down -v: {leftovers(engine, stack.project)['volumes']}")
    _, restore_seconds = restore(stack, directory)
    stack.pause_nightly()
    stack.compose("up", "-d", "serve", profiles=("serve",))
    stack.wait_healthy(["serve"], 420)
    after = {"mlflow": mlflow_state(stack), "prefect": prefect_state(stack), "served": served_answers(stack, images)}
    found = differences(before, after)
    if found:
        raise StepError(f"{len(found)} differences after the restore: {'; '.join(found[:4])}")
    shutil.rmtree(directory)  # ~240 MB; kept when the drill fails, beside the command log.
    sizes = ", ".join(f"{stored.name} {stored.bytes / 1e6:.1f} MB" for stored in manifest.files)
    mlflow, prefect = after["mlflow"], after["prefect"]
    histories = sum(len(run["metrics"]) for run in mlflow["runs"].values())
    schedules = sum(len(deployment["schedules"]) for deployment in prefect["deployments"].values())
    row.detail = (
        f"backup in {manifest.seconds:.0f} s ({sizes}); down -v; restore in {restore_seconds:.0f} s; all back: "
        f"{len(mlflow['runs'])} runs, {histories} metric histories, {len(mlflow['versions'])} model versions, "
        f"champion v{mlflow['champion']}, {len(prefect['deployments'])} deployments ({schedules} schedules), "
        f"{len(prefect['flow_runs'])} finished flow runs; served answers on {SERVED_IMAGES} test images identical"
    )
    context.report.facts.append(
        ("Backup / restore of the stack", f"{manifest.seconds:.0f} s / {restore_seconds:.0f} s ({time.strftime('%F')})")
    )
