"""A pipeline run through the stack: the smoke deployment, what it left in PostgreSQL and MLflow, a restart."""

from __future__ import annotations

import time

from cifar.summary import PipelineSummary
from scripts.stack_check.context import Context
from scripts.stack_check.report import Row
from scripts.stack_check.shell import StepError
from scripts.stack_check.stack import ARTIFACTS, WORKDIR, Stack, archive_parameters

MODEL_NAME = "cifar10"
ZOMBIE_AUTOMATION = "cifar: crash flow runs whose heartbeats stopped"


def check_smoke_run(context: Context, row: Row) -> None:
    stack = context.stack
    parameters = {"config": {"preset": "smoke", "data": archive_parameters(context.settings.archive)}}
    started = time.monotonic()
    flow_run_id = stack.deployment_run("cifar/smoke", parameters, watch=True, command_line=True)
    run = stack.wait_flow_run(flow_run_id, {"COMPLETED"}, timeout=120)
    values = stack.read_json("worker", f"{WORKDIR}/summary.json")
    summary = PipelineSummary.model_validate(values) if values else None
    reached_registry = summary is not None and summary.evaluation and summary.export and summary.promotion
    if not reached_registry or summary.preset != "smoke":
        raise StepError("no smoke summary.json of a run to the registry on the workdir volume")
    context.findings.smoke_flow_run, context.findings.smoke_summary = flow_run_id, summary
    row.detail = (
        f"flow run {run['name']} COMPLETED in {time.monotonic() - started:.0f} s; "
        f"test accuracy {summary.evaluation.test_accuracy:.4f}, export v{summary.export.version}, "
        f"registry v{summary.promotion.registered_model_version} champion={summary.promotion.champion}"
    )


def check_prefect_database(context: Context, row: Row) -> None:
    stack, flow_run_id = context.stack, context.findings.smoke_flow_run
    api_state = stack.flow_run(flow_run_id)["state"]["type"]
    database = stack.variables.get("CIFAR_PREFECT_DB") or "prefect"
    rows = stack.psql(
        database,
        "SELECT fr.state_type, f.name, d.name FROM flow_run fr JOIN flow f ON f.id = fr.flow_id "
        f"JOIN deployment d ON d.id = fr.deployment_id WHERE fr.id = '{flow_run_id}'",
    )
    if api_state != "COMPLETED" or rows != [["COMPLETED", "cifar", "smoke"]]:
        raise StepError(f"API says {api_state}, PostgreSQL has {rows}")
    automations = stack.prefect("POST", "/automations/filter", {})
    if not any(automation["name"] == ZOMBIE_AUTOMATION for automation in automations):
        raise StepError("the worker did not create the zombie flow run automation")
    row.detail = f"API and table flow_run in database {database}: COMPLETED (cifar/smoke); zombie automation present"


def artifact_files(stack: Stack, experiment_id: str) -> list[str]:
    """The files of an experiment on the `mlartifacts` volume, as the MLflow container sees them."""
    return stack.exec("mlflow", "find", f"{ARTIFACTS}/{experiment_id}", "-type", "f", timeout=60).stdout.split()


def check_mlflow(context: Context, row: Row) -> None:
    stack, summary = context.stack, context.findings.smoke_summary
    run_id = summary.training.mlflow_run_id
    run = stack.mlflow("runs/get", run_id=run_id)["run"]
    metrics = {metric["key"]: metric["value"] for metric in run["data"].get("metrics", [])}
    if run["info"]["status"] != "FINISHED" or "test_accuracy" not in metrics:
        raise StepError(f"MLflow run {run_id}: {run['info']['status']}, metrics {sorted(metrics)}")
    if not run["info"]["artifact_uri"].startswith("mlflow-artifacts:"):  # Through the server, not a client path.
        raise StepError(f"MLflow run {run_id} keeps its artifacts at {run['info']['artifact_uri']}")
    if abs(metrics["test_accuracy"] - summary.evaluation.test_accuracy) > 1e-6:
        raise StepError(
            f"MLflow has test_accuracy {metrics['test_accuracy']}, the run wrote {summary.evaluation.test_accuracy}"
        )
    champion = stack.mlflow("registered-models/alias", name=MODEL_NAME, alias="champion")["model_version"]
    if champion["run_id"] != run_id:
        raise StepError(f"champion v{champion['version']} is from run {champion['run_id']}, not {run_id}")
    artifacts = stack.mlflow("artifacts/list", run_id=run_id).get("files", [])
    if not artifacts:
        raise StepError("the run lists no artifacts")
    database = stack.variables.get("CIFAR_MLFLOW_DB") or "mlflow"
    stored = stack.psql(database, f"SELECT value FROM metrics WHERE run_uuid = '{run_id}' AND key = 'test_accuracy'")
    aliased = stack.psql(database, f"SELECT version FROM registered_model_aliases WHERE name = '{MODEL_NAME}'")
    if not stored or abs(float(stored[0][0]) - metrics["test_accuracy"]) > 1e-6 or aliased != [[champion["version"]]]:
        raise StepError(f"PostgreSQL database {database} holds {stored} and alias {aliased}")
    files = artifact_files(stack, run["info"]["experiment_id"])
    model_files = [path for path in files if path.endswith(("/MLmodel", "/saved_model.pb"))]
    run_files = [path for path in files if f"/{run_id}/" in path]
    if len(model_files) < 2 or not run_files:
        raise StepError(f"{ARTIFACTS} on the volume holds {len(files)} files, no logged model or run artifacts")
    findings = context.findings
    findings.mlflow_run_id, findings.champion_version, findings.artifact_files = run_id, champion["version"], len(files)
    accuracy = f"{metrics['test_accuracy']:.4f}"
    context.report.facts.append(("Smoke run's test accuracy, read back from the containerised MLflow", accuracy))
    row.detail = (
        f"run {run['info']['run_name']} FINISHED, test_accuracy {metrics['test_accuracy']:.4f} (also in "
        f"PostgreSQL), champion v{champion['version']}, {len(artifacts)} run artifact entries, {len(files)} files "
        f"on the mlartifacts volume (MLmodel + saved_model.pb)"
    )


def check_restart(context: Context, row: Row) -> None:
    stack, findings = context.stack, context.findings
    started = time.monotonic()
    stack.down()
    if stack.containers():
        raise StepError(f"containers left after down: {stack.containers()}")
    stack.up()
    stack.pause_nightly()
    run = stack.flow_run(findings.smoke_flow_run)
    mlflow_run = stack.mlflow("runs/get", run_id=findings.mlflow_run_id)["run"]
    champion = stack.mlflow("registered-models/alias", name=MODEL_NAME, alias="champion")["model_version"]
    files = artifact_files(stack, mlflow_run["info"]["experiment_id"])
    if (
        run["state"]["type"] != "COMPLETED"
        or mlflow_run["info"]["status"] != "FINISHED"
        or champion["version"] != findings.champion_version
        or len(files) != findings.artifact_files
        or not stack.read_json("worker", f"{WORKDIR}/summary.json")
    ):
        raise StepError("something is missing after the restart")
    row.detail = (
        f"down (containers removed, volumes kept) and up again in {time.monotonic() - started:.0f} s: flow run "
        f"COMPLETED, MLflow run FINISHED, champion v{champion['version']}, {len(files)} artifact files, workdir"
    )
