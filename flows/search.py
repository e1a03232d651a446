"""The `cifar-search` flow: a hyperparameter search whose trials are `cifar` runs on a work pool's workers.

    python flows/search.py --source cifar-10-python.tar.gz --sha256 HEX --preset smoke --trials 8 --parallel 2
    prefect deployment run cifar-search/search -p trials=32 -p parallel=4      # on a server's work pool

An Optuna study (`cifar.search`) proposes the trials; without a server the command line starts a local
pool (flows/local_pool.py). Studies, pruning and results: docs/ORCHESTRATION.md, "Hyperparameter search".
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from uuid import UUID

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # This checkout first, installed or not.

from flows.runtime import DryRunPlan, Request, dry_run_plan, run_command, show_stage_logs

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from pydantic import Field, ValidationError

from cifar.config import ConfigOverrides, PipelineConfig, TrialLink, resolve_workdir
from cifar.preflight import check_request
from cifar.search import results as search_results
from cifar.search import study as studies
from cifar.search.results import BestTrial, SearchSummary
from cifar.search.space import OBJECTIVE, SPACE_PRESETS, SearchSpace, load_space
from cifar.tracking import mlflow_client, resolve_tracking_uri
from flows.cli import add_run_arguments, add_set_argument, config_from_args, describe_validation_error, flow_parser
from flows.local_pool import local_work_pool
from tasks.search import attach_trial_run, close_search, open_search_run, open_study, registered_version

TRIAL_DEPLOYMENT = "cifar/trial"  # prefect.yaml: the `cifar` flow, parameters filled in by the search.
POLL_SECONDS = 2.0  # Between looks at the trials in flight.
SearchUntil = Literal["train", "evaluate", "export"]


def trial_parameters(
    base: dict[str, Any], params: dict[str, Any], workdir: str, until: str, link: TrialLink | None = None
) -> dict[str, Any]:
    """The `cifar` flow's parameters for a trial: the base overrides with the trial's settings on top."""
    config = copy.deepcopy(base)
    config["train"] = {**config.get("train", {}), **params}
    if link is not None:
        config["trial"] = link.model_dump(mode="json", exclude_none=True)
    return {"config": config, "workdir": workdir, "until": until}


class TrialDispatcher:
    """Keeps up to `parallel` trials of a study running as flow runs of the trial deployment."""

    def __init__(self, study, space: SearchSpace, *, base: dict[str, Any], workdir: str, storage: str, deployment: str):
        self.study = study
        self.space = space
        self.base = base
        self.workdir = workdir
        self.storage = storage
        self.deployment = deployment
        self.in_flight: dict[int, UUID] = {}

    def dispatch(self, number: int) -> None:
        """Creates the trial's flow run (the same one again, for a trial already dispatched to this server)."""
        link = TrialLink(storage=studies.link_storage(self.storage), study_name=self.study.study_name, number=number)
        params = studies.trial_params(self.study, number)
        parameters = trial_parameters(self.base, params, self.workdir, "train", link)
        flow_run = run_deployment(
            self.deployment,
            parameters=parameters,
            timeout=0,
            flow_run_name=f"{self.study.study_name}-trial-{number}",
            idempotency_key=f"{self.study.study_name}-trial-{number}",
            tags=["cifar-search"],
        )
        studies.record_dispatch(self.study, number, str(flow_run.id))
        self.in_flight[number] = flow_run.id
        print(f"Trial {number} dispatched as flow run {flow_run.name}: {params}")

    def adopt_running(self) -> None:
        """After a restart: waits for the trials still running, dispatches again those whose run is gone."""
        for number, flow_run_id in studies.running_trials(self.study).items():
            flow_run = read_flow_run(flow_run_id) if flow_run_id else None
            if flow_run is None:
                print(f"Trial {number} has no live flow run: dispatching it again")
                self.dispatch(number)
            else:
                print(f"Trial {number} is still running as flow run {flow_run.name}: waiting for it")
                self.in_flight[number] = flow_run.id

    def fill(self, target: int, parallel: int) -> None:
        """Asks the study for new trials while there is room and the target is not reached."""
        while len(self.in_flight) < parallel and studies.count_finished(self.study) + len(self.in_flight) < target:
            number, _ = studies.ask_trial(self.study, self.space)
            self.dispatch(number)

    def run(self, target: int, parallel: int) -> Iterator[int]:
        """Keeps trials in flight until `target` have finished; yields each trial whose flow run ended."""
        self.adopt_running()
        while True:
            self.fill(target, parallel)
            if not self.in_flight:
                return
            time.sleep(POLL_SECONDS)
            yield from self.reap()

    def reap(self) -> list[int]:
        """The trials whose flow run ended since the last look; a run that died before telling fails its trial."""
        ended = []
        for number, flow_run_id in list(self.in_flight.items()):
            flow_run = read_flow_run(str(flow_run_id))
            if flow_run is not None and not flow_run.state.is_final():
                continue
            if flow_run is None:
                reason = f"flow run {flow_run_id} disappeared"
            else:
                reason = f"flow run {flow_run.name} ended {flow_run.state.name}: {flow_run.state.message or ''}"
            studies.fail_trial(self.study, number, reason)  # No-op when the trial told its outcome.
            del self.in_flight[number]
            ended.append(number)
        return ended


def read_flow_run(flow_run_id: str | UUID):
    """The flow run, or None when the server does not know it (a run of an earlier, temporary server)."""
    with get_client(sync_client=True) as client:
        try:
            return client.read_flow_run(UUID(str(flow_run_id)))
        except ObjectNotFound:
            return None


def warn_if_trainings_serialise(parallel: int) -> None:
    """Says so when the `training` tag limit is below `parallel` (trials would queue for the device)."""
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_concurrency_limit_by_tag("training").concurrency_limit
        except ObjectNotFound:
            return
    if limit < parallel:
        print(f"Note: the `training` concurrency limit is {limit}: at most {limit} of {parallel} trials train at once")


def evaluate_best(
    best: BestTrial, *, base: dict[str, Any], workdir: str, until: str, deployment: str, tracking_uri: str
) -> BestTrial:
    """Runs the best trial's settings to `until` as an ordinary `cifar` run (its training is reused)."""
    parameters = trial_parameters(base, best.params, workdir, until)
    flow_run = run_deployment(deployment, parameters=parameters, flow_run_name=f"best-trial-{best.number}")
    if flow_run.state is None or not flow_run.state.is_completed():
        message = flow_run.state.message if flow_run.state else "no state"
        raise RuntimeError(f"the best trial's {until} run {flow_run.name} did not complete: {message}")
    evaluated = best.model_copy(update={"flow_run_id": str(flow_run.id), "until": until})
    if best.mlflow_run_id:
        metrics = mlflow_client(tracking_uri).get_run(best.mlflow_run_id).data.metrics
        evaluated.test_accuracy = metrics.get("test_accuracy")
        if until == "export":
            evaluated.registered_model_version = registered_version(tracking_uri, best.mlflow_run_id)
    return evaluated


def record_best(summary: SearchSummary, best: BestTrial, tracking_uri: str) -> SearchSummary:
    """The best trial's evaluation in search-summary.json and on the MLflow parent run."""
    summary = summary.model_copy(update={"best": best})
    search_results.write_summary(summary, summary.workdir)
    client = mlflow_client(tracking_uri)
    if best.test_accuracy is not None:
        client.log_metric(summary.parent_run_id, "best_test_accuracy", best.test_accuracy)
    if best.registered_model_version is not None:
        client.set_tag(summary.parent_run_id, "best_registered_version", str(best.registered_model_version))
    return summary


@flow(name="cifar-search", log_prints=True)
def cifar_search(
    config: ConfigOverrides = ConfigOverrides(preset="smoke"),
    space: str = "smoke",
    trials: Annotated[int, Field(ge=1, le=10_000)] = 8,
    parallel: Annotated[int, Field(ge=1, le=1_000)] = 2,
    workdir: str = "./workdir",
    until: SearchUntil = "export",
    deployment: str = TRIAL_DEPLOYMENT,
    storage: str | None = None,
) -> SearchSummary | DryRunPlan:
    """Runs `trials` trials of the search space, `parallel` at a time, then evaluates and registers the best.

    `space` is a preset (smoke, resnet, grid) or a JSON/YAML file; `storage` the study's store (default:
    CIFAR_SEARCH_STORAGE, else WORKDIR/search/<study>.journal).
    """
    show_stage_logs()
    resolved: PipelineConfig = config.resolve()
    search_space = load_space(space)
    search_space.check_against(resolved)
    plan = dry_run_plan("cifar-search", resolved, workdir, until=until, space=search_space.name, trials=trials)
    if plan:
        return plan
    workdir = str(resolve_workdir(workdir))
    base = config.model_dump(mode="json", exclude_none=True)
    study_name = studies.study_name_for(search_space, resolved)
    storage = studies.resolve_storage(storage, workdir, study_name)
    tracking_uri = resolve_tracking_uri(resolved.tracking, workdir)
    grid_size = search_space.grid_size()
    target = min(trials, grid_size) if grid_size else trials

    study = open_study(storage, study_name, search_space, resolved.seed)
    parent_run_id = open_search_run(resolved, workdir, tracking_uri, study, search_space, storage)
    print(
        f"Study {study_name} in {studies.redact(storage)}: {studies.count_finished(study)} of {target} trials "
        f"finished; MLflow parent run {parent_run_id}"
    )
    warn_if_trainings_serialise(parallel)
    dispatcher = TrialDispatcher(
        study, search_space, base=base, workdir=workdir, storage=storage, deployment=deployment
    )
    for number in dispatcher.run(target, parallel):
        row = search_results.trial_row(study.trials[number])
        print(f"Trial {number} {row.state}: {OBJECTIVE} {row.value} after {row.epochs_reported} epochs")
        attach_trial_run(tracking_uri, parent_run_id, study_name, row)
    for row in search_results.trial_rows(study):  # Every child nested, also those of an earlier attempt.
        attach_trial_run(tracking_uri, parent_run_id, study_name, row)

    context = {"preset": resolved.preset, "space": search_space.model_dump(mode="json"), "until": until}
    context |= {"trials_requested": target, "parallel": parallel, "deployment": deployment, "workdir": workdir}
    summary = close_search(study, workdir, tracking_uri, parent_run_id, storage, context)
    if summary.best and until != "train":
        best = evaluate_best(
            summary.best, base=base, workdir=workdir, until=until, deployment=deployment, tracking_uri=tracking_uri
        )
        summary = record_best(summary, best, tracking_uri)
    print(format_search(summary))
    return summary


def format_search(summary: SearchSummary) -> str:
    """A few human lines: the counts, the best trial and where everything is."""
    counts, best = summary.counts, summary.best
    lines = [
        f"cifar search done: study {summary.study_name} ({summary.storage})",
        f"  trials     {counts.complete} complete, {counts.pruned} pruned, {counts.failed} failed",
    ]
    if best:
        lines.append(f"  best       trial {best.number}: {OBJECTIVE} {best.value:.4f} {best.params}")
        if best.test_accuracy is not None:
            lines.append(f"  test       accuracy {100 * best.test_accuracy:.2f} %")
        if best.registered_model_version is not None:
            lines.append(f"  registry   version {best.registered_model_version}")
    lines.append(f"  mlflow     parent run {summary.parent_run_id}")
    lines.append(f"  summary    {summary.summary_path}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = flow_parser(
        "search",
        "Hyperparameter search over the CIFAR-10 pipeline (Prefect flow `cifar-search`, Optuna).",
        "--source cifar-10-python.tar.gz --sha256 HEX --preset smoke --trials 8 --parallel 2",
    )
    add_run_arguments(
        parser,
        preset="smoke",
        workdir="where data, runs, the study and search-summary.json go",
        preset_help="the pipeline preset every trial starts from",
    )
    add = parser.add_argument
    presets = ", ".join(sorted(SPACE_PRESETS))
    add("--space", default="smoke", help=f"search space: a preset ({presets}) or a JSON/YAML file")
    add("--trials", type=int, default=8, help="trials the study should reach (finished ones count after a restart)")
    add("--parallel", type=int, default=2, help="trials at once (without a server: local workers)")
    help_until = "what the best trial gets after the search: train (nothing), evaluate, or export and register"
    add("--until", default="export", choices=("train", "evaluate", "export"), help=help_until)
    add("--storage", help="the study's store: a journal file or a database URL (default: CIFAR_SEARCH_STORAGE, "
        "else WORKDIR/search/<study>.journal)")  # fmt: skip
    add("--deployment", default=TRIAL_DEPLOYMENT, help="the `cifar` deployment trials run as (with a server)")
    add_set_argument(parser, "train.steps_per_epoch=20", "one config field of every trial")
    parser.set_defaults(fresh=False)  # config_from_args reads it; a search never discards runs.
    return parser


def check_request_args(args: argparse.Namespace):
    """The validated config and space of a command line; raises ValueError naming the bad field."""
    if args.trials < 1 or args.parallel < 1:
        raise ValueError(f"--trials and --parallel must be at least 1, got {args.trials} and {args.parallel}")
    config = config_from_args(args)
    check_request(config)
    try:
        space = load_space(args.space)
    except ValidationError as error:
        message = describe_validation_error(error).replace("invalid configuration: ", "invalid space: ")
        raise ValueError(message) from None
    space.check_against(config)
    return config, space


def check(args: argparse.Namespace) -> Request:
    """The validated request; the search runs on the server's pool, or on a local one for its length."""
    config, _ = check_request_args(args)
    workdir = resolve_workdir(args.workdir)
    arguments = {
        "config": ConfigOverrides.of(config),
        "space": args.space if args.space in SPACE_PRESETS else str(os.path.abspath(args.space)),
        "trials": args.trials,
        "parallel": args.parallel,
        "workdir": str(workdir),
        "until": args.until,
        "deployment": args.deployment,
        "storage": args.storage,
    }

    def run() -> int:
        from prefect.settings import get_current_settings

        if get_current_settings().api.url:
            summary = cifar_search(**arguments)
        else:
            # A trial with train.workers = N places N - 1 workers of its own next to it.
            with local_work_pool(args.parallel * config.train.workers, workdir / "logs"):
                summary = cifar_search(**arguments)
        print(format_search(summary))  # The terminal shows one line of each log record: the summary in full.
        return 0

    return Request(workdir, run)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command("search", build_parser(), check, argv, ephemeral_server=False, error_type=True)


if __name__ == "__main__":
    sys.exit(main())
