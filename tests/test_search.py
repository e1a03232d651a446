"""The hyperparameter search: its typed space, its study, and a real search on a Prefect server's workers.

Unit tests need no TensorFlow and no server: the space's validation, the study's bookkeeping in a
journal file, the summary. The integration tests share one search (module fixture, to keep the suite
inside its time budget): a Prefect server on 127.0.0.1 with two process workers, `prefect deploy` of
prefect.yaml's `cifar/trial`, and `python flows/search.py` of 6 smoke-sized trials over a space with
hopeless points (learning rate 1e-6), killed with SIGKILL once two trials have finished and started
again to completion. One test checks the finished search, the other the kill and the resume.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from cifar.config import TrialLink, make_config
from cifar.io import file_digest
from cifar.search import results
from cifar.search import study as studies
from cifar.search.space import SPACE_PRESETS, SearchSpace, load_space
from cifar.workdir import stable_hash
from harness import REPO_ROOT
from harness.prefect import prefect_api, prefect_env
from harness.processes import run_cli, stop_all
from harness.servers import start_prefect_server, start_worker

# --- The space. ------------------------------------------------------------------------------------


def space(**params) -> dict:
    return {"name": "unit", "params": params}


def test_space_presets_fit_the_presets_they_are_for():
    SPACE_PRESETS["smoke"].check_against(make_config("smoke"))
    SPACE_PRESETS["grid"].check_against(make_config("smoke"))
    SPACE_PRESETS["resnet"].check_against(make_config("default"))
    assert SPACE_PRESETS["grid"].grid_size() == 4  # flows/sweep.py's default grid: 2 models x 2 rates.


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (space(learning_rate={"type": "float", "low": 0.1, "high": 0.01}), "low (0.1) must be below high (0.01)"),
        (space(learning_rate={"type": "float", "low": 0.0, "high": 0.1, "log": True}), "a log range needs low > 0"),
        (space(learnin_rate={"type": "categorical", "choices": [0.1]}), "params.learnin_rate: not a train field"),
        (space(run_name={"type": "categorical", "choices": ["a"]}), "params.run_name: a search does not vary"),
        (space(model={"type": "categorical", "choices": []}), "at least 1 item"),
        (
            {"name": "g", "sampler": "grid", "params": {"weight_decay": {"type": "float", "low": 0, "high": 1}}},
            "params.weight_decay: a grid search takes categorical choices only",
        ),
        (
            {
                **space(learning_rate={"type": "float", "low": 0.01, "high": 0.1}),
                "first_trials": [{"learning_rate": 0.5}],
            },
            "first_trials[0].learning_rate: 0.5 is outside [0.01, 0.1]",
        ),
        (
            {**space(batch_size={"type": "categorical", "choices": [32, 64]}), "first_trials": [{"batch_size": 48}]},
            "first_trials[0].batch_size: 48 is not one of the choices [32, 64]",
        ),
        (
            {**space(epochs={"type": "int", "low": 2, "high": 8, "step": 2}), "first_trials": [{}, {"epochs": 3}]},
            "first_trials[1].epochs: 3 is not on the step 2 from 2",
        ),
        (
            {**space(epochs={"type": "int", "low": 2, "high": 8}), "first_trials": [{"model": "tiny"}]},
            "first_trials[0].model: not one of the space's params",
        ),
        (
            {**space(model={"type": "categorical", "choices": ["tiny"]}), "sampler": "grid", "first_trials": [{}]},
            "first_trials: a grid search tries every combination once",
        ),
    ],
)
def test_a_bad_space_fails_naming_the_field(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SearchSpace.model_validate(spec)


def test_a_value_the_pipeline_refuses_fails_before_any_trial():
    bad = SearchSpace.model_validate(space(learning_rate={"type": "float", "low": 0.01, "high": 500}))
    with pytest.raises(ValueError, match=r"space.params.learning_rate: 500.0 is refused: .*less than or equal to 100"):
        bad.check_against(make_config("smoke"))
    model = SearchSpace.model_validate(space(model={"type": "categorical", "choices": ["tiny", "resnet21"]}))
    with pytest.raises(ValueError, match="space.params.model: 'resnet21' is refused: ResNet depth must be 6n"):
        model.check_against(make_config("smoke"))
    with pytest.raises(ValueError, match="needs a validation split"):
        SPACE_PRESETS["smoke"].check_against(make_config("smoke", {"data": {"validation_size": 0}}))
    # A first trial is checked whole: each value fits on its own, not the two together.
    params = {"epochs": {"type": "int", "low": 2, "high": 3}, "warmup_epochs": {"type": "float", "low": 0, "high": 2}}
    together = [{"epochs": 3, "warmup_epochs": 2}, {"epochs": 2, "warmup_epochs": 2}]
    first = SearchSpace.model_validate({**space(**params), "first_trials": together})
    with pytest.raises(
        ValueError, match=r"space.first_trials\[1\]: .* is refused: warmup_epochs \(2.0\) must be shorter"
    ):
        first.check_against(make_config("smoke", {"train": {"epochs": 3, "schedule": "cosine"}}))


def test_a_space_loads_from_a_preset_a_json_or_a_yaml_file(tmp_path):
    spec = {"name": "file", "params": {"batch_size": {"type": "categorical", "choices": [32, 64]}}}
    (tmp_path / "space.json").write_text(json.dumps(spec))
    (tmp_path / "space.yaml").write_text("name: file\nparams:\n  batch_size: {type: categorical, choices: [32, 64]}\n")
    assert load_space(tmp_path / "space.json") == load_space(tmp_path / "space.yaml") == SearchSpace(**spec)
    assert load_space("smoke") is SPACE_PRESETS["smoke"]
    with pytest.raises(ValueError, match="neither a preset"):
        load_space(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("space.json", b"\x80", "is not a readable JSON file: 'utf-8' codec can't decode byte 0x80"),
        ("space.json", b"{", "is not a readable JSON file: Expecting property name enclosed in double quotes"),
        ("space.json", b"[" * 100_000, "is not a readable JSON file: maximum recursion depth exceeded"),
        ("space.yaml", b"name: [unclosed", "is not a readable YAML file: while parsing a flow sequence"),
        ("space.yaml", b"!!python/object/apply:os.system ['touch MARKER']", "could not determine a constructor"),
        ("space.yaml", b"a0: &a0 [x, x, x, x, x, x, x, x]\n" + b"".join(
            f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * 8)}]\n".encode() for level in range(1, 9)
        ) + b"name: x", "stands for more than 10,000 values (YAML aliases)"),
    ],
    ids=["not UTF-8", "not JSON", "JSON nested past the recursion limit", "not YAML", "a YAML tag that runs code",
         "YAML aliases standing for 134 million values"],
)  # fmt: skip
def test_a_space_file_that_cannot_be_read_is_named_in_one_line(tmp_path, monkeypatch, name, content, message):
    # Found by the fuzz suite (tests/test_fuzz_search_spaces.py, issue 39): the parser's own error without the
    # file's name, a RecursionError or a YAMLError (no ValueError: a traceback at the command line), and a
    # 500-byte YAML file whose aliases the validation would have walked 134 million times.
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError) as raised:
        load_space(tmp_path / name)
    assert str(raised.value).startswith(f"space: {tmp_path / name} ") and message in str(raised.value)
    assert "\n" not in str(raised.value) and not (tmp_path / "MARKER").exists()


def test_storage_passwords_never_leave_the_environment():
    url = "postgresql://cifar:s3cret@postgres:5432/optuna"
    assert studies.redact(url) == "postgresql://cifar:***@postgres:5432/optuna"
    assert studies.link_storage(url) is None  # The worker reads CIFAR_SEARCH_STORAGE instead.
    assert studies.link_storage("/w/search/s.journal") == "/w/search/s.journal"


# --- The study. ------------------------------------------------------------------------------------

PRUNING_SPACE = SearchSpace.model_validate(
    {
        "name": "unit",
        "params": {"learning_rate": {"type": "float", "low": 0.001, "high": 0.1, "log": True}},
        "pruner": {"kind": "median", "startup_trials": 1, "min_epochs": 1},
    }
)


def test_trials_report_prune_and_tell_their_outcome_in_a_shared_journal(tmp_path):
    storage = str(tmp_path / "search" / "unit.journal")
    study = studies.open_study(storage, "unit", PRUNING_SPACE, seed=0)
    first, _ = studies.ask_trial(study, PRUNING_SPACE)
    second, params = studies.ask_trial(study, PRUNING_SPACE)
    studies.record_dispatch(study, second, "flow-run-2")
    assert studies.running_trials(study) == {first: None, second: "flow-run-2"}

    # Each trial's run opens the study anew (another process), reports per epoch and tells its outcome.
    good = studies.TrialReporter(TrialLink(storage=storage, study_name="unit", number=first))
    assert [good.report(epoch, value) for epoch, value in ((1, 0.5), (2, 0.6))] == [False, False]
    link = TrialLink(storage=storage, study_name="unit", number=first)
    studies.start_trial(link)
    assert studies.finish_trial(link, value=0.6, pruned=False, mlflow_run_id="run-0", run_name="r0") == "COMPLETE"
    bad = studies.TrialReporter(TrialLink(storage=storage, study_name="unit", number=second))
    assert bad.report(1, 0.1) is True  # Below the median of the finished trial at epoch 1.
    link = TrialLink(storage=storage, study_name="unit", number=second)
    assert studies.finish_trial(link, value=0.1, pruned=True, mlflow_run_id="run-1", run_name="r1") == "PRUNED"
    # Telling again (a re-run of the same flow run) keeps the first outcome.
    assert studies.finish_trial(link, value=0.9, pruned=False, mlflow_run_id="run-1", run_name="r1") == "PRUNED"

    third, _ = studies.ask_trial(study, PRUNING_SPACE)
    studies.fail_trial(study, third, "flow run x ended Crashed")
    reopened = studies.open_study(storage, "unit", PRUNING_SPACE, seed=0)  # A restarted search.
    assert studies.count_finished(reopened) == 3 and studies.running_trials(reopened) == {}

    summary = results.build_summary(reopened, storage=storage, parent_run_id="parent")
    assert [(row.number, row.state) for row in summary.trials] == [(0, "COMPLETE"), (1, "PRUNED"), (2, "FAIL")]
    assert summary.trials[1].params == params and summary.trials[1].mlflow_run_id == "run-1"
    assert summary.trials[2].failure == "flow run x ended Crashed"
    assert summary.best == results.BestTrial(
        number=0, params=summary.trials[0].params, value=0.6, mlflow_run_id="run-0", run_name="r0"
    )
    for row in summary.trials:
        assert datetime.fromisoformat(row.started).utcoffset().total_seconds() == 0
        assert row.finished.endswith("Z")
    path = results.write_summary(summary, tmp_path)
    written = json.loads(path.read_text())
    assert written["counts"] == {"COMPLETE": 1, "PRUNED": 1, "FAIL": 1}
    assert results.SearchSummary.model_validate(written) == summary  # The file reads back as the same summary.

    other = PRUNING_SPACE.model_copy(update={"sampler": "random"})
    with pytest.raises(ValueError, match="was made for another search space"):
        studies.open_study(storage, "unit", other, seed=0)


def test_first_trials_run_in_order_once_then_the_sampler_picks(tmp_path):
    first_trials = [{"learning_rate": 0.05}, {"learning_rate": 0.002}, {}]
    space_with_first = PRUNING_SPACE.model_copy(update={"first_trials": first_trials})
    storage = str(tmp_path / "search" / "first.journal")
    study = studies.open_study(storage, "first", space_with_first, seed=0)
    number, params = studies.ask_trial(study, space_with_first)
    assert (number, params) == (0, {"learning_rate": 0.05})
    # A restarted search finds the rest still queued, and queues nothing again.
    reopened = studies.open_study(storage, "first", space_with_first, seed=0)
    asked = [studies.ask_trial(reopened, space_with_first) for _ in range(3)]
    assert [number for number, _ in asked] == [1, 2, 3] and asked[0][1] == {"learning_rate": 0.002}
    assert all(0.001 <= params["learning_rate"] <= 0.1 for _, params in asked[1:])  # The empty point is sampled.
    assert len(reopened.trials) == 4

    # Only a space with first trials names another study: studies made before they existed are found.
    # The name digests the space as it was dumped before `first_trials` existed (the key left out).
    config = make_config("smoke")
    space = SPACE_PRESETS["smoke"]
    before = {key: value for key, value in space.model_dump(mode="json").items() if key != "first_trials"}
    base = config.model_dump(mode="json", exclude={"trial", "tracking"})
    name_before = f"smoke-smoke-{stable_hash({'space': before, 'config': base}, 8)}"
    assert studies.study_name_for(space, config) == name_before
    with_first = space.model_copy(update={"first_trials": [{"model": "tiny"}]})
    assert studies.study_name_for(with_first, config) != name_before


@pytest.mark.slow
def test_the_command_line_refuses_a_bad_space_before_any_work(tmp_path, capsys):
    # The command line's entry point in this process: a refused request ends before any process is started.
    from flows.search import main

    (tmp_path / "space.json").write_text(json.dumps(space(epochs={"type": "int", "low": 0, "high": 3})))
    assert main(["--space", str(tmp_path / "space.json"), "--workdir", str(tmp_path / "w")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: space.params.epochs: 0 is refused: Input should be greater than or equal to 1"
    ]
    assert not (tmp_path / "w" / "search").exists()


# --- The local pool of a search without a server. ------------------------------------------------

LOCAL_POOL_SCRIPT = """
import sys
from pathlib import Path
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings
from flows.local_pool import local_work_pool

with local_work_pool(2, Path(sys.argv[1])) as api_url, temporary_settings({PREFECT_API_URL: api_url}):
    with get_client(sync_client=True) as client:
        workers = client.read_workers_for_work_pool("cifar-process")
        deployment = client.read_deployment_by_name("cifar/trial")
        print(sorted(worker.name for worker in workers), deployment.work_pool_name)
"""


@pytest.mark.slow
def test_the_local_pool_of_a_background_search_starts_its_workers_and_stops_them_cleanly(tmp_path):
    # Started as `flows/search.py ... &` from a script: SIGINT ignored, as every child inherits, and the
    # Prefect CLI stops its worker with SIGINT. Such workers never stopped (killed after 20 s each).
    result = subprocess.run(
        [sys.executable, "-c", LOCAL_POOL_SCRIPT, str(tmp_path / "logs")],
        cwd=REPO_ROOT, env=prefect_env(tmp_path / "prefect"), capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "['local-0', 'local-1'] cifar-process"
    logs = sorted((tmp_path / "logs").glob("pool-worker-*.log"))
    assert len(logs) == 2
    for index, log in enumerate(logs):
        assert f"Worker 'local-{index}' stopped!" in log.read_text(), log.read_text()[-2000:]


# --- A real search on a work pool. ---------------------------------------------------------------

TRIALS = 6
HOPELESS_SPACE = {
    "name": "hopeless",
    "params": {
        # 1e-6 learns nothing in 3 epochs: hopeless. The decay makes every trial's settings distinct.
        "learning_rate": {"type": "categorical", "choices": [1e-6, 0.05]},
        "weight_decay": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
    },
    "pruner": {"kind": "median", "startup_trials": 2, "min_epochs": 1},
    # Three that learn, then two hopeless ones asked once two have finished, so the pruner has its bar
    # (left to the sampler, the hopeless draws fell among the first two now and then: nothing pruned).
    # The sixth is the sampler's.
    "first_trials": [{"learning_rate": 0.05}] * 3 + [{"learning_rate": 1e-6}] * 2,
}
SEARCH_TIMEOUT_SECONDS = 480


@dataclass
class Search:
    workdir: Path
    summary: dict
    api_url: str
    killed_returncode: int
    finished_at_kill: dict[int, str]  # Trial number -> its `finished` time when the search was killed.
    resumed_output: str


def search_command(archive: str, workdir: Path, space_path: Path) -> list[str]:
    return [
        sys.executable, "flows/search.py", "--source", archive, "--sha256", file_digest(archive),
        "--workdir", str(workdir), "--preset", "smoke", "--trials", str(TRIALS), "--parallel", "2",
        "--space", str(space_path), "--until", "export",
        "--set", "data.expect_official_counts=false", "--set", "data.validation_size=100",
        "--set", "train.model=tiny", "--set", "train.epochs=3", "--set", "train.steps_per_epoch=3",
        "--set", "train.batch_size=32", "--set", "tracking.system_metrics=false",
    ]  # fmt: skip


def finished_trials(journal: Path) -> dict[int, str]:
    import optuna

    if not journal.exists():
        return {}
    try:
        [name] = optuna.get_all_study_names(studies.open_storage(str(journal)))
        study = optuna.load_study(study_name=name, storage=studies.open_storage(str(journal)))
    except ValueError:
        return {}
    return {row.number: row.finished for row in results.trial_rows(study) if row.finished}


@pytest.fixture(scope="module")
def search(python_archive, tmp_path_factory) -> Search:
    root = tmp_path_factory.mktemp("search")
    server = start_prefect_server(root / "prefect")
    workers = []
    try:
        env = server.client_env(TF_CPP_MIN_LOG_LEVEL="2")
        run_cli(["prefect", "work-pool", "create", "cifar-process", "--type", "process"], env=env)
        run_cli(["prefect", "concurrency-limit", "create", "training", "2"], env=env)  # Two trainings at once.
        run_cli(["prefect", "--no-prompt", "deploy", "--name", "trial"], env=env, cwd=REPO_ROOT)
        for index in range(2):
            extra = {"PWD": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": ""}
            workers.append(start_worker(server, "cifar-process", name=f"worker-{index}", extra_env=extra))
        space_path = root / "space.json"
        space_path.write_text(json.dumps(HOPELESS_SPACE))
        workdir = root / "workdir"
        command = search_command(python_archive, workdir, space_path)
        with open(root / "first.log", "wb") as log:
            first = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        journals = workdir / "search"
        deadline = time.monotonic() + SEARCH_TIMEOUT_SECONDS
        finished: dict[int, str] = {}
        while len(finished) < 2 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
            finished = next((finished_trials(path) for path in journals.glob("*.journal")), {})
        assert first.poll() is None, (root / "first.log").read_text()[-4000:]
        os.killpg(first.pid, signal.SIGKILL)  # The search flow and its supervisor, as a power cut would.
        killed_returncode = first.wait(30)
        finished = next(finished_trials(path) for path in journals.glob("*.journal"))

        second = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                timeout=SEARCH_TIMEOUT_SECONDS)  # fmt: skip
        diagnostics = f"{second.stdout[-3000:]}\n{second.stderr[-3000:]}\n{workers[0].logs()[-3000:]}"
        assert second.returncode == 0, diagnostics
        summary = json.loads((workdir / "search-summary.json").read_text())
        yield Search(workdir, summary, server.api_url, killed_returncode, finished, second.stdout + second.stderr)
    finally:
        stop_all(workers)
        server.stop()


def trial_flow_runs(api_url: str, study_name: str) -> dict[int, list[dict]]:
    """Trial number -> the flow runs the search created for it (found by their `trial` parameter)."""
    response = prefect_api.post(
        f"{api_url}/flow_runs/filter", json={"flow_runs": {"tags": {"all_": ["cifar-search"]}}, "limit": 200}
    )
    runs: dict[int, list[dict]] = {}
    for run in response.json():
        link = run["parameters"]["config"].get("trial") or {}
        if link.get("study_name") == study_name:
            runs.setdefault(link["number"], []).append(run)
    return runs


@pytest.mark.integration
def test_a_search_runs_trials_in_parallel_prunes_and_registers_the_best(search):
    import mlflow
    import optuna

    summary, trials = search.summary, search.summary["trials"]
    assert len(trials) == TRIALS and {row["state"] for row in trials} <= {"COMPLETE", "PRUNED", "FAIL"}

    # At least two trials ran at the same time, on the two workers.
    spans = [(datetime.fromisoformat(row["started"]), datetime.fromisoformat(row["finished"])) for row in trials]
    assert any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1 :]), spans

    # The space's first trials ran first, in order; the sampler picked the rest.
    first = [row["params"]["learning_rate"] for row in sorted(trials, key=lambda row: row["number"])][:5]
    assert first == [point["learning_rate"] for point in HOPELESS_SPACE["first_trials"]]

    # At least one hopeless trial was pruned: PRUNED in Optuna, "Pruned" in Prefect, tagged in MLflow,
    # with the epochs it trained kept.
    pruned = [row for row in trials if row["state"] == "PRUNED"]
    assert pruned, trials
    tracking_uri = f"sqlite:///{search.workdir / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    runs = trial_flow_runs(search.api_url, summary["study_name"])
    for row in pruned:
        [flow_run] = runs[row["number"]]
        assert (flow_run["state"]["type"], flow_run["state"]["name"]) == ("COMPLETED", "Pruned")
        index = json.loads((search.workdir / "runs" / row["run_name"] / "checkpoints" / "index.json").read_text())
        assert 1 <= row["epochs_reported"] < 3 and index["entries"][-1]["epoch"] == row["epochs_reported"]
        assert client.get_run(row["mlflow_run_id"]).data.tags["cifar.trial_state"] == "PRUNED"

    # The study, the MLflow parent's children and the summary agree trial for trial.
    storage = studies.open_storage(summary["storage"])
    study = optuna.load_study(study_name=summary["study_name"], storage=storage)
    assert [(t.number, t.state.name, t.params) for t in study.trials] == [
        (row["number"], row["state"], row["params"]) for row in trials
    ]
    children = client.search_runs(
        [client.get_run(summary["parent_run_id"]).info.experiment_id],
        f"tags.mlflow.parentRunId = '{summary['parent_run_id']}'",
    )
    assert {(int(run.data.tags["cifar.trial_number"]), run.data.tags["cifar.trial_state"], run.info.run_id)
            for run in children} == {(row["number"], row["state"], row["mlflow_run_id"]) for row in trials}  # fmt: skip
    for run in children:  # Each child holds its trial's settings and its per-epoch validation accuracy.
        row = trials[int(run.data.tags["cifar.trial_number"])]
        assert float(run.data.params["train.learning_rate"]) == row["params"]["learning_rate"]
        assert len(client.get_metric_history(run.info.run_id, "val_accuracy")) >= row["epochs_reported"]
    parent_artifacts = {item.path for item in client.list_artifacts(summary["parent_run_id"], "plots")}
    assert "plots/optimization_history.png" in parent_artifacts

    # The best trial was evaluated, exported and registered through the gate.
    best = summary["best"]
    assert best["value"] == max(row["value"] for row in trials if row["state"] == "COMPLETE")
    assert best["params"]["learning_rate"] == 0.05 and best["registered_model_version"] is not None
    version = client.get_model_version("cifar10", str(best["registered_model_version"]))
    assert version.run_id == best["mlflow_run_id"] and best["test_accuracy"] is not None


@pytest.mark.integration
def test_a_killed_search_resumes_its_study_without_rerunning_finished_trials(search):
    assert search.killed_returncode == -signal.SIGKILL
    assert 2 <= len(search.finished_at_kill) < TRIALS
    # Trials in flight at the kill go on on their workers, so more may have finished when the search resumes.
    resumed = re.search(rf"(\d+) of {TRIALS} trials finished", search.resumed_output)
    assert resumed and len(search.finished_at_kill) <= int(resumed.group(1)) <= TRIALS, search.resumed_output[-3000:]
    trials = {row["number"]: row for row in search.summary["trials"]}
    for number, finished in search.finished_at_kill.items():  # Untouched by the second attempt.
        assert trials[number]["finished"] == finished
    # Every trial ran as exactly one flow run: trials in flight at the kill were waited for, not repeated.
    runs = trial_flow_runs(search.api_url, search.summary["study_name"])
    assert {number: [run["id"] for run in runs[number]] for number in trials} == {
        number: [row["flow_run_id"]] for number, row in trials.items()
    }
