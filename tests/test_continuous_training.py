"""The continuous-training loop through a real Prefect server and worker, as a team runs it.

An archive with one training batch left out; the nightly retrain deployment trains the first champion;
run again, it does nothing; the left-out batch and a small folder of images are ingested with
`flows/ingest.py` (the README's command) at once; prefect.yaml's trigger on `cifar.data.added` retrains
once for both; its challenger is compared with the champion on
the same test images and the alias moves as the rule says; `flows/promote.py` rolls back and promotes
by hand, with the record on the version.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import pytest
from test_prefect_server import POOL, Stack, artifacts, flow_run_logs, wait_for

from cifar.data.manifest import load_manifest
from cifar.data.synthetic import build_archive, make_split, source_arrays, write_batch_file, write_image_folder
from cifar.io import file_digest
from cifar.summary import PipelineSummary
from harness import REPO_ROOT
from harness.prefect import prefect_api
from harness.servers import deploy_project, start_prefect_server, start_worker

pytestmark = pytest.mark.integration

TRAIN_PER_BATCH, TEST_EXAMPLES = 100, 200
DEBOUNCE_SECONDS = 60  # prefect.yaml: the trigger's `within` and `schedule_after`.
TEST_DEBOUNCE_SECONDS = 30  # The same automation, its window shortened (both ingests end well inside it), faster.


def smoke_config() -> dict:
    """The nightly deployment's config for this test: the smoke preset, a tiny model, a few steps; no archive,
    so the retrain takes the workdir's own."""
    return {
        "preset": "smoke",
        "data": {"expect_official_counts": False, "validation_size": 100},
        "train": {"model": "tiny", "epochs": 2, "steps_per_epoch": 3, "batch_size": 32},
        "tracking": {"system_metrics": False},
    }


@pytest.fixture(scope="module")
def loop(tmp_path_factory) -> tuple[Stack, dict]:
    """A server with prefect.yaml's nightly retrain deployment (on the smoke config), its triggers, and a worker."""
    home = tmp_path_factory.mktemp("prefect-home")
    server = start_prefect_server(home)
    worker = None
    try:
        env = deploy_project(server, POOL, names=["nightly"])
        nightly = prefect_api.get(f"{server.api_url}/deployments/name/cifar-retrain/nightly").json()
        response = prefect_api.patch(
            f"{server.api_url}/deployments/{nightly['id']}",
            json={"parameters": {**nightly["parameters"], "config": smoke_config()}},
        )
        assert response.status_code == 204, response.text
        worker = start_worker(
            server, POOL, cwd=REPO_ROOT, extra_env={"PWD": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": ""}
        )
        yield Stack(server, worker, env), nightly
    finally:
        if worker is not None:
            worker.stop()
        server.stop()


def shorten_debounce(api_url: str) -> None:
    """The retrain trigger prefect.yaml made, checked as written, then with a shorter window for speed."""
    automations = prefect_api.post(f"{api_url}/automations/filter", json={}).json()
    (automation,) = [item for item in automations if item["name"] == "cifar-retrain-on-new-data"]
    trigger, (action,) = automation["trigger"], automation["actions"]
    assert (trigger["expect"], trigger["posture"], trigger["within"]) == (["cifar.data.added"], "Reactive", 60.0)
    assert action["type"] == "run-deployment" and action["schedule_after"] == 60.0
    assert action["parameters"] == {"workdir": "{{ event.payload.workdir }}"}
    trigger["within"], action["schedule_after"] = TEST_DEBOUNCE_SECONDS, TEST_DEBOUNCE_SECONDS
    fields = ("name", "description", "enabled", "tags", "trigger", "actions", "actions_on_trigger",
              "actions_on_resolve", "owner_resource")  # fmt: skip
    body = {key: automation[key] for key in fields if key in automation}
    response = prefect_api.put(f"{api_url}/automations/{automation['id']}", json=body)
    assert response.status_code == 204, response.text


def run_nightly(stack: Stack, nightly: dict, workdir: Path, config: dict | None = None) -> dict:
    parameters = {"workdir": str(workdir)} | ({"config": config} if config else {})
    response = prefect_api.post(
        f"{stack.server.api_url}/deployments/{nightly['id']}/create_flow_run", json={"parameters": parameters}
    )
    assert response.status_code == 201, response.text
    return wait_for(stack, response.json()["id"])


def triggered_runs(stack: Stack, nightly: dict) -> list[dict]:
    """Runs of the nightly deployment the automation created (not the 02:00 schedule's, not ours)."""
    response = prefect_api.post(
        f"{stack.server.api_url}/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [nightly["id"]]}}}
    )
    return [run for run in response.json() if run.get("created_by") and run["created_by"].get("type") == "AUTOMATION"]


def latest_artifact(stack: Stack, key: str) -> dict:
    response = prefect_api.post(
        f"{stack.server.api_url}/artifacts/filter",
        json={"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC", "limit": 1},
    )
    (artifact,) = response.json()
    return artifact


def ingest(stack: Stack, path: Path, workdir: Path) -> subprocess.CompletedProcess:
    """`python flows/ingest.py --add PATH --workdir W`, talking to the server (so its event reaches the trigger)."""
    return subprocess.run(
        [sys.executable, "flows/ingest.py", "--add", str(path), "--workdir", str(workdir)],
        cwd=REPO_ROOT,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_new_data_retrains_once_and_the_challenger_is_judged_on_the_same_images(loop, tmp_path):
    stack, nightly = loop
    archive = build_archive(tmp_path / "base.tar.gz", train_per_batch=TRAIN_PER_BATCH, test_examples=TEST_EXAMPLES,
                            train_batches=4)  # fmt: skip
    left_out = source_arrays(train_per_batch=TRAIN_PER_BATCH, test_examples=TEST_EXAMPLES)["train"]
    batch = write_batch_file(tmp_path / "data_batch_5", left_out[0][400:], left_out[1][400:], name="data_batch_5")
    folder = write_image_folder(tmp_path / "new-photos", *make_split(40, seed=99))
    workdir = tmp_path / "workdir"

    # No champion yet: the nightly run, told the archive this once, trains the first one. The workdir
    # records the archive; every later retrain takes it from there.
    config = smoke_config()
    config["data"] |= {"source": str(archive), "sha256": file_digest(archive)}
    first = run_nightly(stack, nightly, workdir, config)
    assert first["state"]["type"] == "COMPLETED", stack.diagnostics()
    tracking_uri = f"sqlite:///{workdir / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    assert str(client.get_model_version_by_alias("cifar10", "champion").version) == "1"
    runs_before = len(client.search_runs(["1"]))

    # Run again with nothing new: it says so and stops, no training, no MLflow run.
    again = run_nightly(stack, nightly, workdir)
    print(f"nothing-changed run: {again['total_run_time']:.1f} s")  # Reported (README), not asserted.
    assert (again["state"]["type"], again["state"]["name"]) == ("COMPLETED", "Nothing changed")
    assert "nothing changed: champion v1 is current" in again["state"]["message"]
    assert "nothing changed" in artifacts(stack, again["id"])["cifar-retrain"]["data"]
    assert len(client.search_runs(["1"])) == runs_before

    # Two additions at once, through the command line users type: both events inside the window even on
    # busy cores, where one command after the other took longer than the test's shortened window.
    shorten_debounce(stack.server.api_url)
    first_event = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        added, photos = pool.map(lambda path: ingest(stack, path, workdir), [batch, folder])
    assert added.returncode == 0, added.stderr[-3000:]
    assert "added 100 images as" in added.stdout and "validation passed" in added.stdout
    assert photos.returncode == 0, photos.stderr[-3000:]
    again_added = ingest(stack, batch, workdir)  # The same content: nothing to do, no event.
    assert again_added.returncode == 0 and "nothing to do" in again_added.stdout, again_added.stderr[-3000:]
    listing = subprocess.run([sys.executable, "flows/ingest.py", "--list", "--workdir", str(workdir)], cwd=REPO_ROOT,
                             env=stack.env, capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    assert "(latest)" in listing and "+ 2 additions (140 images)" in listing and "batch_file" in listing

    # One training for the burst, after the debounce window. Prefect's automations act at least once: on a
    # busy server the trigger's evaluation can be retried after its action was sent (SQLite "database is
    # locked"), which schedules a second run. That run waits for the first (the deployment's concurrency
    # limit), finds the model trained on this snapshot and ends "Nothing changed": it never trains twice.
    deadline = time.monotonic() + 420
    while not triggered_runs(stack, nightly) and time.monotonic() < deadline:
        time.sleep(3)
    time.sleep(max(0.0, first_event + TEST_DEBOUNCE_SECONDS + 10 - time.monotonic()))  # Past any second firing.
    runs = [wait_for(stack, run["id"]) for run in triggered_runs(stack, nightly)]
    assert runs and all(run["state"]["type"] == "COMPLETED" for run in runs), stack.diagnostics()
    trained = [run for run in runs if run["state"]["name"] != "Nothing changed"]
    assert len(trained) == 1, [(run["name"], run["state"]["name"], run["state"]["message"]) for run in runs]
    (triggered,) = trained

    summary = PipelineSummary.read(workdir / "summary.json")
    assert len(summary.retrain.changes) >= 1 and "+2 additions (140 images" in summary.retrain.changes[0]
    # The test split is the same bytes in both snapshots; the additions' validation images are `new_data`.
    new_manifest = load_manifest(summary.data.data_dir)
    old_dir = next(path for path in (workdir / "data").glob("cifar10-*") if str(path) != summary.data.data_dir)
    assert load_manifest(old_dir).splits["test"] == new_manifest.splits["test"]
    assert new_manifest.splits["train"].num_examples + new_manifest.splits["validation"].num_examples == 400 + 140
    assert "new_data" in new_manifest.slices
    assert "## Robustness" in Path(summary.promotion.model_card).read_text()  # Every registered version has its card.

    # The challenger against the champion on the same 200 test images, recorded, and the alias as the rule says.
    comparison = json.loads(client.get_model_version("cifar10", "2").tags["promotion"])["comparison"]
    assert comparison["examples"] == TEST_EXAMPLES and comparison["champion"]["version"] == 1
    assert {"accuracy", "per_class", "correct"} <= set(comparison["champion"]) and comparison["p_value"] is not None
    assert len(comparison["class_names"]) == 10 and comparison["new_data_examples"] > 0
    champion = str(client.get_model_version_by_alias("cifar10", "champion").version)
    assert champion == ("2" if comparison["promote"] else "1")
    report = latest_artifact(stack, "cifar-comparison")["data"]  # From the retrain's pipeline subflow.
    assert "McNemar" in report and f"{comparison['examples']:,} images" in report
    assert "Retrained on snapshot" in flow_run_logs(stack, triggered["id"], expect="Retrained on snapshot")

    # A person overrides: back to the other version, then forward again, with the record on each version.
    other = "1" if champion == "2" else "2"
    command = [sys.executable, "flows/promote.py", "--workdir", str(workdir), "--by", "alice"]
    moved = subprocess.run([*command, "--version", other, "--reason", "the old one is safer"], cwd=REPO_ROOT,
                           env=stack.env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert str(client.get_model_version_by_alias("cifar10", "champion").version) == other
    rolled = subprocess.run([*command, "--rollback", "--reason", "it was not"], cwd=REPO_ROOT, env=stack.env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    assert str(client.get_model_version_by_alias("cifar10", "champion").version) == champion
    override = json.loads(client.get_model_version("cifar10", champion).tags["override"])
    assert (override["how"], override["by"], override["reason"]) == ("rollback", "alice", "it was not")
    assert json.loads(client.get_model_version("cifar10", other).tags["override"])["reason"] == "the old one is safer"
