"""A person's sign-off and the team's notifications, through a real Prefect server, worker and webhook receiver.

prefect.yaml's nightly retrain (approval required) on a tiny config whose gate passes any challenger: the
first champion waits suspended (its process gone) until `flows/promote.py --approve` decides, and the
resumed run trains nothing; the next challenger is rejected through the form's API (what the UI posts);
the third waits past its timeout, which the scheduled `cifar-approval-timeout` run records. The receiver,
behind the automations `flows/automations.py` makes, hears each event once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from test_continuous_training import smoke_config
from test_prefect_server import POOL, Stack, wait_for

from cifar.data.synthetic import build_archive
from cifar.io import file_digest
from flows.automations import ZOMBIE_AUTOMATION
from harness import REPO_ROOT
from harness.prefect import prefect_api
from harness.servers import deploy_project, start_prefect_server, start_worker
from harness.webhook import WebhookReceiver

pytestmark = pytest.mark.integration

WAITING, MOVED, FAILED = "waits for your approval", "champion is now", "ended Failed"
# Any challenger passes: a tolerated loss of everything, no class limit, and McNemar's refusal below any p that
# 200 test images can give (all 200 disagreeing one way: 1e-60); a chance-level challenger got p = 4e-19.
GATE_PASSES_ALL = {"min_improvement": -1.0, "max_class_drop": 1.0, "significance": 1e-300}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A server with the nightly and approval-timeout deployments (then all, as a stack's worker makes them), the
    notification automations, a worker."""
    home = tmp_path_factory.mktemp("prefect-home")
    stack = Stack(start_prefect_server(home), None, {})
    with WebhookReceiver() as receiver:
        try:
            stack.env = deploy_project(stack.server, POOL, names=["nightly", "approval-timeout"])
            command = [sys.executable, "flows/automations.py", "--crashed-after", "3600"]  # Never fires here.
            nothing = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=stack.env)
            assert nothing.returncode == 0 and "notifications: none" in nothing.stdout, nothing.stderr[-2000:]
            assert "(3600 s, made)" in nothing.stdout
            env = {**stack.env, "CIFAR_NOTIFY_WEBHOOK_URL": receiver.url}
            made = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
            assert made.returncode == 0 and "5 automations" in made.stdout, made.stderr[-2000:]
            assert receiver.url not in made.stdout + made.stderr  # The URL is a secret.
            # A worker starting (docker/entrypoint.sh) changes none of ours: an update would reset what the crash
            # rule watches. The first deploys every deployment (the nightly's trigger with it), the next finds them
            # made from this code and changes nothing at all.
            before = updated_automations(stack)
            ours = {name for name in before if name.startswith("cifar: ")}
            setup = [sys.executable, "flows/worker_setup.py", "--pool", POOL, "--crashed-after", "3600"]
            first = subprocess.run(setup, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
            assert first.returncode == 0 and "(3600 s, as it was)" in first.stdout, first.stderr[-3000:]
            assert "pool and training limit present" in first.stdout and "Deploying smoke" in first.stdout
            deployed = updated_automations(stack)
            assert {name: deployed[name] for name in ours} == {name: before[name] for name in ours}
            again = subprocess.run(setup, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
            assert again.returncode == 0 and "not deployed again" in again.stdout, again.stdout + again.stderr[-3000:]
            assert "Deploying" not in again.stdout and updated_automations(stack) == deployed
            # Then the crash rule goes: on this test server's SQLite, Prefect's two trigger consumers race to insert
            # its per-flow-run bucket; the loser's event is delivered again and every automation evaluates it again,
            # so a notice went out twice (3 of 4 CI runs on 2026-11-28; server log "Failed in consume_loop"). The
            # stack check runs notices beside the crash rule on PostgreSQL.
            crash_rule = next(a for a in prefect_api.post(f"{stack.server.api_url}/automations/filter", json={}).json()
                              if a["name"] == ZOMBIE_AUTOMATION)  # fmt: skip
            assert prefect_api.delete(f"{stack.server.api_url}/automations/{crash_rule['id']}").status_code == 204
            nightly = prefect_api.get(f"{stack.server.api_url}/deployments/name/cifar-retrain/nightly").json()
            assert nightly["parameters"]["config"]["promotion"] == {"approval": "required"}  # As prefect.yaml says.
            extra_env = {"PWD": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": ""}
            stack.worker = start_worker(stack.server, POOL, cwd=REPO_ROOT, extra_env=extra_env)
            yield stack, nightly, receiver
        finally:
            if stack.worker is not None:
                stack.worker.stop()
            stack.server.stop()


def updated_automations(stack: Stack) -> dict[str, str]:
    """Each automation's name and when it was last changed."""
    automations = prefect_api.post(f"{stack.server.api_url}/automations/filter", json={}).json()
    return {automation["name"]: automation["updated"] for automation in automations}


def start_nightly(stack: Stack, nightly: dict, workdir: Path, config: dict, force: bool = False) -> str:
    parameters = {"workdir": str(workdir), "config": config, "force": force}
    response = prefect_api.post(
        f"{stack.server.api_url}/deployments/{nightly['id']}/create_flow_run", json={"parameters": parameters}
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]


def wait_until_waiting(stack: Stack, flow_run_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        flow_run = prefect_api.get(f"{stack.server.api_url}/flow_runs/{flow_run_id}").json()
        if flow_run["state"]["type"] == "PAUSED":
            return flow_run
        assert flow_run["state"]["type"] not in {"COMPLETED", "FAILED", "CRASHED"}, (
            flow_run["state"],
            stack.diagnostics(),
        )
        time.sleep(1)
    raise AssertionError(f"{flow_run_id} not waiting after {timeout} s\n{stack.diagnostics()}")


def processes_of(flow_run_id: str) -> list[int]:
    """Processes whose environment names the flow run (what the process worker starts for it)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if flow_run_id.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def child_runs(stack: Stack, flow_run_id: str) -> list[dict]:
    """The subflow runs of a flow run (the retrain's `cifar` pipeline)."""
    response = prefect_api.post(
        f"{stack.server.api_url}/flow_runs/filter",
        json={"flow_runs": {"parent_flow_run_id": {"operator": "and_", "any_": [flow_run_id]}}},
    )
    assert response.status_code == 200, response.text
    return response.json()


def promote(stack: Stack, workdir: Path, *args: str, account: str = "alice") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "flows/promote.py", "--workdir", str(workdir), *args], cwd=REPO_ROOT,
                          env={**stack.env, "MLFLOW_TRACKING_USERNAME": account}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_approve_reject_and_expire_a_challenger_with_one_notification_each(release, tmp_path):
    stack, nightly, receiver = release
    archive = build_archive(tmp_path / "base.tar.gz", train_per_batch=100, test_examples=200)
    workdir = tmp_path / "workdir"
    config = smoke_config()
    config["data"] |= {"source": str(archive), "sha256": file_digest(archive)}
    config |= {"export": GATE_PASSES_ALL, "promotion": {"approval": "required"}}
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")

    # The first challenger passes the gate and waits, suspended: no champion yet, no process left running.
    first = start_nightly(stack, nightly, workdir, config)
    waited_since = time.monotonic()
    waiting = wait_until_waiting(stack, first)
    assert waiting["state"]["name"] == "Suspended"
    assert not client.get_registered_model("cifar10").aliases
    assert json.loads(client.get_model_version("cifar10", "1").tags["approval"])["state"] == "waiting"
    runs_while_waiting = len(client.search_runs(["1"]))
    (notice,) = receiver.wait_for(WAITING, timeout=60)
    assert "cifar10 v1" in notice and f"/runs/flow-run/{first}" in notice
    deadline = time.monotonic() + 60
    while processes_of(first) and time.monotonic() < deadline:  # The worker reaps the exited run.
        time.sleep(1)
    assert not processes_of(first), "a suspended run must not hold a process (nor its worker)"

    # The command line refuses a run that is not waiting, then approves this one: recorded as the MLflow account.
    refused = promote(stack, workdir, "--approve", nightly["id"], "--reason", "no such run")
    assert refused.returncode == 2 and "no flow run" in refused.stderr
    approved = promote(stack, workdir, "--approve", first, "--reason", "checked the trucks")
    assert approved.returncode == 0, approved.stderr[-3000:]
    print(f"waited {time.monotonic() - waited_since:.0f} s for the decision")
    finished = wait_for(stack, first)
    assert (finished["state"]["type"], finished["state"]["name"]) == ("COMPLETED", "Approved"), stack.diagnostics()
    assert str(client.get_model_version_by_alias("cifar10", "champion").version) == "1"
    record = json.loads(client.get_model_version("cifar10", "1").tags["approval"])
    assert (record["state"], record["decided_by"], record["via"]) == ("approved", "alice", "command line")
    history = json.loads(client.get_registered_model("cifar10").tags["champion_history"])
    assert (history[-1]["how"], history[-1]["by"], history[-1]["version"]) == ("approval", "alice", 1)
    assert len(client.search_runs(["1"])) == runs_while_waiting  # Resumed: nothing trained or logged again.
    assert len(child_runs(stack, first)) == 1  # The pipeline ran once, before the suspension; not after it.
    (moved,) = receiver.wait_for(MOVED, timeout=60)
    assert "v1" in moved and "approval, by alice" in moved
    again = promote(stack, workdir, "--reject", first, "--reason", "too late")
    assert again.returncode == 2 and "not waiting" in again.stderr

    # The second challenger (a forced retrain) waits across a restart of the server, then is rejected through
    # the form: what the UI posts.
    second = start_nightly(stack, nightly, workdir, config, force=True)
    wait_until_waiting(stack, second)
    receiver.wait_for(WAITING, timeout=60, count=2)
    port = stack.server.url.rsplit(":", 1)[1]
    stack.server.stop()
    stack.server = start_prefect_server(stack.server.home, port=int(port))
    answer = {"decision": "reject", "reason": "worse on night photos", "approver": "bob"}
    response = prefect_api.post(f"{stack.server.api_url}/flow_runs/{second}/resume", json={"run_input": answer})
    assert response.status_code == 201 and response.json()["status"] == "ACCEPT", response.text
    finished = wait_for(stack, second)
    assert (finished["state"]["type"], finished["state"]["name"]) == ("COMPLETED", "Rejected"), stack.diagnostics()
    assert str(client.get_model_version_by_alias("cifar10", "champion").version) == "1"
    record = json.loads(client.get_model_version("cifar10", "2").tags["approval"])
    assert (record["state"], record["decided_by"], record["via"], record["reason"]) == (
        "rejected", "bob", "form", "worse on night photos")  # fmt: skip
    assert json.loads(client.get_registered_model("cifar10").tags["champion_history"])[-1]["moved"] is False

    # The third waits past its timeout: the scheduled timeout run records the expiry and ends the waiting run.
    short = config | {"promotion": {"approval": "required", "approval_timeout_hours": 0.004}}  # 14.4 s
    third = start_nightly(stack, nightly, workdir, short, force=True)
    wait_until_waiting(stack, third)
    finished = wait_for(stack, third)
    assert finished["state"]["type"] == "FAILED" and "No decision in 0.004 h" in finished["state"]["message"]
    assert json.loads(client.get_model_version("cifar10", "3").tags["approval"])["state"] == "expired"
    assert str(client.get_model_version_by_alias("cifar10", "champion").version) == "1"

    # Each notification once: three waits, one move, one failed run (the expired wait).
    receiver.wait_for(FAILED, timeout=60)
    time.sleep(5)  # Room for a duplicate to arrive, were one sent.
    print("\n".join(receiver.texts()))
    assert [len(receiver.matching(text)) for text in (WAITING, MOVED, FAILED)] == [3, 1, 1], receiver.texts()


def test_a_command_line_run_pauses_in_its_process_until_the_command_line_decides(release, tmp_path):
    # Without a deployment Prefect cannot reschedule a run, so it waits paused, its process alive; the
    # decision from another terminal resumes it there.
    stack, _, receiver = release
    archive = build_archive(tmp_path / "base.tar.gz", train_per_batch=100, test_examples=200)
    workdir = tmp_path / "workdir"
    settings = {"train.model": "tiny", "train.epochs": 2, "train.steps_per_epoch": 3, "train.batch_size": 32,
                "data.expect_official_counts": "false", "data.validation_size": 100,
                "tracking.system_metrics": "false", "promotion.approval": "required"}  # fmt: skip
    command = [sys.executable, "flows/retrain.py", "--source", str(archive), "--sha256", file_digest(archive),
               "--preset", "smoke", "--workdir", str(workdir)]  # fmt: skip
    command += [word for name, value in settings.items() for word in ("--set", f"{name}={value}")]
    serverless = {key: value for key, value in stack.env.items() if key != "PREFECT_API_URL"}
    refused = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=serverless)
    assert refused.returncode == 2 and "promotion.approval=required waits" in refused.stderr
    run = subprocess.Popen(command, cwd=REPO_ROOT, env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)  # fmt: skip
    try:
        deadline, paused = time.monotonic() + 300, []
        while not paused and time.monotonic() < deadline and run.poll() is None:
            response = prefect_api.post(f"{stack.server.api_url}/flow_runs/filter",
                                        json={"flow_runs": {"state": {"type": {"any_": ["PAUSED"]}}}})  # fmt: skip
            paused = [item for item in response.json() if item["state"]["name"] == "Paused"]
            time.sleep(1)
        assert paused and run.poll() is None, run.communicate(timeout=10)[0][-3000:]
        decided = promote(stack, workdir, "--approve", paused[0]["id"], "--reason", "looks right", account="carol")
        assert decided.returncode == 0, decided.stderr[-3000:]
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output[-3000:]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    assert str(client.get_model_version_by_alias("cifar10", "champion").version) == "1"
    assert json.loads(client.get_model_version("cifar10", "1").tags["approval"])["decided_by"] == "carol"
    receiver.wait_for("approval, by carol", timeout=60)


EMIT_LIKE_THE_SERVICES = """
from types import SimpleNamespace
from flows.predict import emit_drift
from flows.serve import prefect_events

send = prefect_events()  # The endpoint's hook, as flows/serve.py installs it on its follower.
for _ in range(2):  # An endpoint restarted while the alias still points at the damaged version.
    send("cifar.serving.version.refused", {"model": "cifar10", "alias": "champion", "version": 9, "serving": 8,
                                           "reason": "the SavedModel does not load"})
report = SimpleNamespace(metrics=lambda: {"monitor_drift": 1.0}, reasons=["image drift 0.31 > 0.05 (brightness)"])
emit_drift(SimpleNamespace(model_name="cifar10", model_version=8, input="/data/night", digest="d" * 64, images=500,
                           predictions_path="/w/predictions/p.parquet", monitoring=report), "/w")
"""


def test_the_endpoints_refusal_and_a_drift_alarm_reach_the_team_once(release):
    # The endpoint's and batch prediction's own emitters (flows/serve.py, flows/predict.py) against the server.
    stack, _, receiver = release
    sent = subprocess.run([sys.executable, "-c", EMIT_LIKE_THE_SERVICES], cwd=REPO_ROOT, env=stack.env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert sent.returncode == 0, sent.stderr[-3000:]
    (refused,) = receiver.wait_for("the endpoint refused cifar10 v9", timeout=60)
    assert "keeps its running version" in refused and "does not load" in refused
    (drift,) = receiver.wait_for("drift in the images scored by cifar10 v8", timeout=60)
    assert "500 images of /data/night" in drift and "brightness" in drift
    time.sleep(5)
    assert len(receiver.matching("the endpoint refused cifar10 v9")) == 1, receiver.texts()
