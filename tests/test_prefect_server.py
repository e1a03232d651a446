"""The pipeline deployed on a real Prefect server: a worker runs it, caches it, survives a crash.

Everything runs on 127.0.0.1 with an isolated PREFECT_HOME: `prefect server start`, the work pool,
`prefect deploy --all` from prefect.yaml, a process worker, and `prefect deployment run cifar/smoke`
on a generated archive with the tiny model. MLflow is a SQLite file in the test's tmp directory.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from flows.runtime import DryRunPlan

import pytest

from cifar.io import file_digest
from cifar.reuse import STAGE_MODULES, code_version
from cifar.summary import PipelineSummary
from harness import REPO_ROOT
from harness.ports import free_port
from harness.prefect import prefect_api
from harness.processes import ProcessHandle, run_cli
from harness.servers import ServerHandle, deploy_project, start_prefect_server, start_worker

pytestmark = pytest.mark.integration

POOL = "cifar-process"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
# The download task is never cached: the archive's digest is computed every run (it keys the data).
EXPENSIVE_TASKS = ("prepare", "train", "evaluate", "export", "register")
TASK_STAGES = {"prepare": "data", "train": "train", "evaluate": "evaluate", "export": "export", "register": "register"}
RUN_TIMEOUT_SECONDS = 420


@dataclass
class Stack:
    server: ServerHandle
    worker: ProcessHandle
    env: dict[str, str]

    def diagnostics(self) -> str:
        return f"--- worker log\n{self.worker.logs()[-6000:]}\n--- server log\n{self.server.logs()[-3000:]}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    home = tmp_path_factory.mktemp("prefect-home")
    server = start_prefect_server(home)
    worker = None
    try:
        env = deploy_project(server, POOL)
        worker = start_worker(
            server,
            POOL,
            cwd=REPO_ROOT,
            extra_env={
                "PWD": str(REPO_ROOT),  # The pull step's working directory.
                "CUDA_VISIBLE_DEVICES": "",
            },
        )
        yield Stack(server, worker, env)
    finally:
        if worker is not None:
            worker.stop()
        server.stop()


def smoke_parameters(archive: str, workdir: Path, tracking_uri: str, **train: object) -> dict:
    """cifar/smoke on the generated archive: the tiny model, a few steps, MLflow in a SQLite file."""
    return {
        "workdir": str(workdir),
        "config": {
            "preset": "smoke",
            "data": {
                "source": archive,
                "sha256": file_digest(archive),
                "expect_official_counts": False,
                "validation_size": 100,
            },
            "train": {"model": "tiny", "epochs": 2, "steps_per_epoch": 3, "batch_size": 32, **train},
            "tracking": {"tracking_uri": tracking_uri, "system_metrics": False},
        },
    }


def run_deployment(stack: Stack, name: str, parameters: dict, env_vars: dict[str, str] | None = None) -> str:
    """Creates a flow run of deployment `name` and returns its id."""
    args = ["prefect", "deployment", "run", name, "--params", json.dumps(parameters)]
    if env_vars:  # Replaces the pool's `env` job variable from prefect.yaml: repeat what it sets.
        env_vars = {"PREFECT_LOGGING_EXTRA_LOGGERS": "cifar,tasks", **env_vars}
        args += ["--job-variable", f"env={json.dumps(env_vars)}"]
    output = run_cli(args, env=stack.env).stdout
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", output)
    assert match, output
    return match.group(1)


def wait_for(stack: Stack, flow_run_id: str) -> dict:
    """Polls the flow run until it reaches a terminal state; returns it."""
    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        flow_run = prefect_api.get(f"{stack.server.api_url}/flow_runs/{flow_run_id}").json()
        if flow_run["state"]["type"] in TERMINAL:
            return flow_run
        assert stack.worker.alive(), stack.diagnostics()
        time.sleep(2)
    raise AssertionError(f"flow run {flow_run_id} not finished after {RUN_TIMEOUT_SECONDS}s\n{stack.diagnostics()}")


def task_states(stack: Stack, flow_run_id: str) -> dict[str, str]:
    """Task name (without the run suffix) -> state name, for the tasks of the flow run."""
    response = prefect_api.post(
        f"{stack.server.api_url}/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}}
    )
    return {run["name"].rsplit("-", 1)[0]: run["state"]["name"] for run in response.json()}


def flow_run_logs(stack: Stack, flow_run_id: str, expect: str | None = None, timeout: float = 60.0) -> str:
    """Every log line of the flow run, page by page; with `expect`, waits until a line contains it.

    A flow run's last lines (its summary) reach the server after its final state: the run's process
    ships logs in batches, so a test that reads right after COMPLETED may be early.
    """
    deadline = time.monotonic() + timeout
    while True:
        messages, offset = [], 0
        while True:
            page = prefect_api.post(
                f"{stack.server.api_url}/logs/filter",
                json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200, "offset": offset},
            ).json()
            messages += [entry["message"] for entry in page]
            offset += len(page)
            if len(page) < 200:
                break
        text = "\n".join(messages)
        if expect is None or expect in text or time.monotonic() > deadline:
            return text
        time.sleep(1)


def artifacts(stack: Stack, flow_run_id: str) -> dict[str, dict]:
    """Artifact key -> artifact, for the artifacts of the flow run (its tasks' included)."""
    response = prefect_api.post(
        f"{stack.server.api_url}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
    )
    return {artifact["key"]: artifact for artifact in response.json() if artifact["key"]}


def code_versions() -> dict[str, str]:
    return {stage: code_version(stage) for stage in STAGE_MODULES}


def expected_cached(before: dict[str, str]) -> dict[str, str]:
    """Every expensive task is Cached, except after a stage whose `cifar/` code was edited meanwhile.

    An edit changes that stage's key (correctly), and the stages after it are not checked either.
    """
    expected, edited = {}, False
    for name in EXPENSIVE_TASKS:
        edited = edited or code_version(TASK_STAGES[name]) != before[TASK_STAGES[name]]
        if not edited:
            expected[name] = "Cached"
    return expected


def duration(flow_run: dict) -> float:
    return float(flow_run["total_run_time"])


def test_smoke_deployment_runs_then_reuses_every_stage(stack, python_archive, tmp_path):
    workdir, tracking_uri = tmp_path / "workdir", f"sqlite:///{tmp_path / 'mlflow.db'}"
    parameters = smoke_parameters(python_archive, workdir, tracking_uri)
    versions = code_versions()

    first = wait_for(stack, run_deployment(stack, "cifar/smoke", parameters))
    assert first["state"]["type"] == "COMPLETED", f"{first['state']}\n{stack.diagnostics()}"
    summary = PipelineSummary.read(workdir / "summary.json")
    export_dir, run_id = summary.export.export_dir, summary.training.mlflow_run_id
    assert Path(export_dir, "saved_model.pb").is_file()
    assert summary.promotion.registered_model_version == 1 and summary.promotion.champion is True
    import mlflow

    run = mlflow.MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
    assert run.data.metrics["test_accuracy"] == pytest.approx(summary.evaluation.test_accuracy)
    assert all(state == "Completed" for name, state in task_states(stack, first["id"]).items()), task_states(
        stack, first["id"]
    )
    shown = artifacts(stack, first["id"])
    assert shown["training"]["type"] == "progress" and float(shown["training"]["data"]) == 100.0
    report = shown["cifar-report"]["data"]
    assert "Test accuracy" in report and export_dir in report and run_id in report
    assert "| airplane |" in report  # The per-class table.
    assert "](http://127.0.0.1:5000/#/experiments/" in report and "make mlflow-ui" in report  # A clickable link.
    assert summary.mlflow.name.startswith("smoke-tiny-lr0.05-")  # preset-model-rate-UTC time.
    summary_line = "cifar pipeline done (preset smoke"  # The CLI's summary, in the flow run's logs.
    assert summary_line in flow_run_logs(stack, first["id"], expect=summary_line)

    second = wait_for(stack, run_deployment(stack, "cifar/smoke", parameters))
    assert second["state"]["type"] == "COMPLETED", f"{second['state']}\n{stack.diagnostics()}"
    states, expected = task_states(stack, second["id"]), expected_cached(versions)
    assert {name: states[name] for name in expected} == expected
    if "export" in expected:
        assert PipelineSummary.read(workdir / "summary.json").export.export_dir == export_dir
    if len(expected) == len(EXPENSIVE_TASKS):
        assert duration(second) < duration(first) / 2, (duration(first), duration(second))


def test_crash_mid_training_fails_the_run_and_the_rerun_resumes(stack, python_archive, tmp_path):
    workdir, tracking_uri = tmp_path / "workdir", f"sqlite:///{tmp_path / 'mlflow.db'}"
    parameters = smoke_parameters(python_archive, workdir, tracking_uri, run_name="crash-drill")
    parameters["until"] = "train"

    crashed = wait_for(stack, run_deployment(stack, "cifar/smoke", parameters, {"CIFAR_RAISE_AT": "train.reported:1"}))
    assert crashed["state"]["type"] == "FAILED", crashed["state"]
    assert "CIFAR_RAISE_AT=train.reported:1" in crashed["state"]["message"], crashed["state"]["message"]
    checkpoint_dir = workdir / "runs" / "crash-drill" / "checkpoints"
    first_epoch = checkpoint_dir / "epoch-0001.keras"
    assert first_epoch.is_file() and not (checkpoint_dir / "epoch-0002.keras").exists()
    written = first_epoch.stat().st_mtime_ns

    resumed = wait_for(stack, run_deployment(stack, "cifar/smoke", parameters))
    assert resumed["state"]["type"] == "COMPLETED", f"{resumed['state']}\n{stack.diagnostics()}"
    resumed_line = "resuming crash-drill after epoch 1"
    assert resumed_line in flow_run_logs(stack, resumed["id"], expect=resumed_line)
    assert first_epoch.stat().st_mtime_ns == written  # Epoch 1 was not trained again.
    summary = PipelineSummary.read(workdir / "summary.json")
    assert summary.training.epochs_completed == 2 and (checkpoint_dir / "epoch-0002.keras").is_file()


def test_sweep_groups_its_child_runs_under_one_mlflow_parent(stack, python_archive, tmp_path):
    workdir, tracking_uri = tmp_path / "workdir", f"sqlite:///{tmp_path / 'mlflow.db'}"
    parameters = smoke_parameters(python_archive, workdir, tracking_uri, epochs=1, steps_per_epoch=2)
    parameters |= {"models": ["tiny"], "learning_rates": [0.02, 0.05], "until": "train"}
    names = ["smoke-tiny-lr0.02", "smoke-tiny-lr0.05"]

    swept = wait_for(stack, run_deployment(stack, "cifar-sweep/sweep", parameters))
    assert swept["state"]["type"] == "COMPLETED", f"{swept['state']}\n{stack.diagnostics()}"
    children = prefect_api.post(
        f"{stack.server.api_url}/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [swept["id"]]}}}
    ).json()
    assert sorted(child["name"] for child in children) == names
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("cifar10")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # The model-training view.

    def sweep_runs() -> tuple[list, dict]:
        runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
        parents = [run for run in runs if run.data.tags.get("cifar.sweep") == "parent"]
        nested = {
            parent.info.run_id: [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
            for parent in parents
        }
        return parents, nested

    parents, nested = sweep_runs()
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    first = nested[parents[0].info.run_id]
    assert sorted(run.info.run_name for run in first) == names  # Named as the Prefect flow runs.
    assert sorted(run.data.params["train.learning_rate"] for run in first) == ["0.02", "0.05"]
    assert "best_val_accuracy" in parents[0].data.metrics
    assert {"comparison.json", "comparison.png"} <= {
        item.path for item in client.list_artifacts(parents[0].info.run_id)
    }

    # The same sweep again: every point is served from cache. Each gets a child run of its own that links
    # to the run it reused; the first sweep keeps its children.
    again = wait_for(stack, run_deployment(stack, "cifar-sweep/sweep", parameters))
    assert again["state"]["type"] == "COMPLETED", f"{again['state']}\n{stack.diagnostics()}"
    parents, nested = sweep_runs()
    assert len(parents) == 2 and [len(nested[parent.info.run_id]) for parent in parents] == [2, 2]
    assert {run.info.run_id for run in nested[parents[0].info.run_id]} == {run.info.run_id for run in first}
    stand_ins = nested[parents[1].info.run_id]
    assert {run.data.tags["cifar.reused_run_id"] for run in stand_ins} == {run.info.run_id for run in first}
    assert all(run.data.params == client.get_run(run.data.tags["cifar.reused_run_id"]).data.params for run in stand_ins)
    assert all("best_val_accuracy" in run.data.metrics for run in stand_ins)
    table = artifacts(stack, again["id"])["cifar-sweep"]
    assert "%" in table["data"] and "Best by val_accuracy" in table["description"]


def form_parameters(schema: dict, deployment_parameters: dict) -> dict:
    """What "Custom run" submits untouched: the deployment's values over the parameter schema's defaults."""

    def merge(base, override):
        if isinstance(base, dict) and isinstance(override, dict):
            return {key: merge(base.get(key), override.get(key, base.get(key))) for key in base | override}
        return override if override is not None else base

    defaults = {name: field["default"] for name, field in schema["properties"].items() if "default" in field}
    return merge(defaults, deployment_parameters)


def test_every_deployment_form_left_alone_runs_its_preset(stack, tmp_path):
    # Each deployment's "Custom run" form, submitted unchanged, on a worker in dry-run mode: the flow
    # resolves and checks its config, writes it, and trains nothing (the full preset would take hours).
    import yaml

    from cifar.config import ConfigOverrides

    declared = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]
    deployments = prefect_api.post(f"{stack.server.api_url}/deployments/filter", json={}).json()
    by_name = {deployment["name"]: deployment for deployment in deployments}
    assert {entry["name"] for entry in declared} <= set(by_name)
    plans_dir = tmp_path / "plans"
    env = {"CIFAR_DRY_RUN": str(plans_dir), "PREFECT_LOGGING_EXTRA_LOGGERS": "cifar,tasks"}

    # What a person must type into the forms that have required fields (the dry run reads none of it).
    required = {
        "ingest": {"path": "/data/new-labels"},
        "promote": {"reason": "dry run", "version": 1},
        "predict": {"input": "/data/unlabelled"},
        "approval-timeout": {"flow_run_id": "00000000-0000-0000-0000-000000000000"},
    }
    submitted = {}
    # A training job's workers are placed by their chief with its ticket, never from a form.
    for entry in [entry for entry in declared if "training-worker" not in entry.get("tags", [])]:
        deployment = by_name[entry["name"]]
        parameters = form_parameters(deployment["parameter_openapi_schema"], deployment["parameters"])
        parameters |= required.get(entry["name"], {})
        response = prefect_api.post(
            f"{stack.server.api_url}/deployments/{deployment['id']}/create_flow_run",
            json={"parameters": parameters, "job_variables": {"env": env}},
        )
        assert response.status_code == 201, response.text
        declared_config = entry["parameters"].get("config")  # cifar-promote and its timeout have none.
        submitted[entry["name"]] = (response.json()["id"], deployment, declared_config)

    plans = {}
    for name, (flow_run_id, _, _) in submitted.items():
        finished = wait_for(stack, flow_run_id)
        assert finished["state"]["type"] == "COMPLETED", f"{name}: {finished['state']}\n{stack.diagnostics()}"
    for path in plans_dir.glob("*/summary.json"):
        plan = DryRunPlan.read(path)
        plans[plan.deployment_id] = plan
    for name, (_, deployment, declared_config) in submitted.items():
        plan = plans[deployment["id"]]
        if declared_config is None:
            assert plan.config is None and set(required[name]) <= set(plan.details), name
            continue
        # The preset, and only what prefect.yaml sets besides (the nightly's promotion.approval).
        expected = ConfigOverrides.model_validate(declared_config).resolve()
        assert plan.config.model_dump(mode="json") == expected.model_dump(mode="json"), name

    # A value outside a closed set never becomes a run: the server validates the form.
    smoke = by_name["smoke"]
    rejected = prefect_api.post(
        f"{stack.server.api_url}/deployments/{smoke['id']}/create_flow_run",
        json={"parameters": {"config": {"preset": "smok"}}},
    )
    assert rejected.status_code in (409, 422) and "preset" in rejected.text, rejected.text


@pytest.mark.parametrize(
    "launcher",
    [None, [str(REPO_ROOT / "scripts" / "prefect_server.sh")]],
    ids=["prefect-server-start", "scripts-prefect-server-sh"],
)
def test_a_server_restart_neither_stores_an_event_twice_nor_strands_a_training_slot(tmp_path, launcher):
    # Events arrive at least once: a client resends what it has not checkpointed when it reconnects,
    # e.g. after a server restart, whose in-memory duplicate filter starts empty. Stock 3.8.8 on
    # SQLite then runs an INSERT without rows and logs "NOT NULL constraint failed: events.occurred"
    # (docs/ORCHESTRATION.md); scripts/prefect_server.sh keeps the one stored copy, quietly.
    # A training holds a `training` slot under a lease across the restart: its release afterwards must
    # free the slot (with leases in the server's memory it found nothing and the slot stayed taken).
    import asyncio
    import uuid

    from prefect.events.clients import PrefectEventsClient
    from prefect.events.schemas.events import Event, Resource

    home, port = tmp_path / "prefect-home", free_port()
    event = Event(event="cifar.test.redelivered", id=uuid.uuid4(), resource=Resource({"prefect.resource.id": "t"}))

    async def deliver(api_url: str) -> None:
        async with PrefectEventsClient(api_url=api_url) as client:
            await client.emit(event)

    lease_id = None
    for delivery in ("original", "after restart"):
        server = start_prefect_server(
            home,
            launcher=launcher,
            port=port,
            PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL="0.5",
            PREFECT_SERVER_SERVICES_EVENT_PERSISTER_MAX_FLUSH_RETRIES="2",
        )
        try:
            limits = f"{server.api_url}/v2/concurrency_limits"
            if lease_id is None:  # A training starts and takes the slot.
                prefect_api.post(f"{limits}/", json={"name": "tag:training", "limit": 1}).raise_for_status()
                taken = prefect_api.post(f"{limits}/increment-with-lease", json={"names": ["tag:training"], "slots": 1})
                lease_id = taken.json()["lease_id"]
            else:  # After the restart, it ends and gives the slot back.
                released = prefect_api.post(f"{limits}/decrement-with-lease", json={"lease_id": lease_id})
                assert released.status_code == 204, released.text
                slots = prefect_api.get(f"{limits}/tag:training").json()["active_slots"]
                assert slots == 0, "the restarted server forgot the lease: the training slot stays taken"
            asyncio.run(deliver(server.api_url))
            time.sleep(4)  # Flushes (and, for the duplicate, the failed flush and its retry).
            stored = prefect_api.post(
                f"{server.api_url}/events/filter",
                json={
                    "filter": {
                        "event": {"name": ["cifar.test.redelivered"]},
                        "occurred": {"since": "2000-01-01T00:00:00Z"},
                    }
                },
            )
        finally:
            server.stop()
        assert [item["id"] for item in stored.json()["events"]] == [str(event.id)], delivery

    failed = "NOT NULL constraint failed: events.occurred" in server.logs()
    assert failed is (launcher is None), server.logs()[-3000:]
