"""The `cifar` flow: the raw archive in; verified shards, a trained model, test metrics and a gated export out.

    python flows/pipeline.py --source ~/cifar-10-python.tar.gz --preset smoke
    python flows/pipeline.py --preset full --set train.epochs=100 --set train.gpus=1
    python flows/pipeline.py --source URL --sha256 HEX --until data --workdir /scratch/cifar
    python flows/pipeline.py --preset smoke --set train.workers=2    # one training, two processes

Returns, and writes as WORKDIR/summary.json, a `cifar.summary.PipelineSummary`; reuse and the command line:
README and docs/ORCHESTRATION.md.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # This checkout first, installed or not.

from flows.runtime import DryRunPlan, Request, dry_run_plan, named_by_config, run_command, show_stage_logs

from prefect import flow
from prefect.states import Completed, State

from cifar import failpoints
from cifar.config import STAGES, ConfigOverrides, Stage, resolve_workdir
from cifar.preflight import check_request
from cifar.summary import MlflowRunLink, PipelineSummary
from cifar.tracking import run_label
from flows.approval import check_approval_reachable, is_subflow, wait_for_approval
from flows.cli import add_run_arguments, add_set_argument, config_from_args, flow_parser
from flows.local_pool import local_work_pool
from tasks.artifacts import publish_report, write_summary
from tasks.caching import result_storage
from tasks.data import download_archive, prepare_dataset, resolve_snapshot
from tasks.data_gate import log_validation, validate_data
from tasks.evaluation import evaluate_model, export_model, register_model
from tasks.search import finish_trial, start_trial
from tasks.training import train_model


class Stages:
    """The pipeline's tasks bound to the workdir's result storage; remembers how each run ended (Cached, ...)."""

    def __init__(self, workdir: str, *, refresh: bool, fresh: bool) -> None:
        self.storage = result_storage(workdir)
        self.states: dict[str, str] = {}
        self.download = self._bind(download_archive, refresh)
        self.snapshot = self._bind(resolve_snapshot, refresh)
        self.prepare = self._bind(prepare_dataset, refresh)
        self.validate = self._bind(validate_data, refresh)
        self.train = self._bind(train_model, refresh or fresh)  # Training from scratch never reuses a result.
        self.evaluate = self._bind(evaluate_model, refresh)
        self.export = self._bind(export_model, refresh)
        self.register = self._bind(register_model, refresh)

    def _bind(self, task, refresh: bool):
        configured = task.with_options(result_storage=self.storage, refresh_cache=True if refresh else None)
        forwards_refresh = "refresh" in inspect.signature(task.fn).parameters  # The library recomputes too.

        def run(*args):
            failpoints.reached(f"before:{task.name}")
            keywords = {"refresh": refresh} if forwards_refresh else {}
            state = configured(*args, **keywords, return_state=True)
            result = state.result()  # Raises the task's real error when it failed.
            # "Reused": the task ran, and the library found the stage's finished output under its key.
            self.states[task.name] = (
                "Reused" if state.name == "Completed" and getattr(result, "reused", False) else state.name
            )
            return result

        return run


def reaches(until: str, stage: str) -> bool:
    """Whether a run that stops after `until` includes `stage`."""
    return STAGES.index(stage) <= STAGES.index(until)


@flow(name="cifar", log_prints=True, flow_run_name=named_by_config(run_label, "cifar-invalid-config"))
def cifar_pipeline(
    config: ConfigOverrides = ConfigOverrides(),
    workdir: str = "./workdir",
    until: Stage = "export",
    refresh: bool = False,
) -> PipelineSummary | DryRunPlan | State:
    """CIFAR-10 from the archive to a gated, exported model; stops after `until`.

    `config` is a preset plus the fields that differ from it; a field left empty comes from the preset.
    """
    show_stage_logs()
    config = config.resolve()
    check_request(config)  # Devices, batch and memory: an impossible request fails before any work.
    plan = dry_run_plan("cifar", config, workdir, until=until)
    if plan:
        return plan
    workdir = str(resolve_workdir(workdir))
    stages = Stages(workdir, refresh=refresh, fresh=not config.train.resume)
    if config.trial is not None:  # A trial of a search (flows/search.py): its study learns when it started.
        start_trial(config)

    archive = stages.download(config, workdir)
    snapshot = stages.snapshot(config, archive, workdir)
    dataset = stages.prepare(config, archive, snapshot, workdir)
    validation = stages.validate(config, archive, dataset, workdir)  # Raises, before training, when data fails.
    summary = PipelineSummary(
        until=until, workdir=workdir, config=config, archive=archive, data=dataset, validation=validation
    )
    last = until
    if reaches(last, "train"):
        training = summary.training = stages.train(config, dataset, workdir)
        log_validation(validation, training)
        summary.mlflow = MlflowRunLink.lookup(training.tracking_uri, training.mlflow_run_id)
        if config.trial is not None:  # The study learns the outcome; a pruned trial goes no further.
            summary.trial_state = finish_trial(config, training)
            last = "train" if summary.pruned else last
    if reaches(last, "evaluate"):
        evaluation = summary.evaluation = stages.evaluate(config, dataset, training, workdir)
    if reaches(last, "export"):
        export = summary.export = stages.export(config, dataset, training, evaluation, workdir)
        if config.export.register_model:
            summary.promotion = stages.register(config, dataset, training, evaluation, export)
    summary.task_states = stages.states
    write_summary(summary)
    publish_report(summary)
    print(summary.describe())  # The same lines as the command line's, in the flow run's logs (log_prints).
    if summary.promotion and summary.promotion.awaiting_approval and not is_subflow():  # A retrain waits itself.
        summary.approval = wait_for_approval(config, summary.promotion, training.tracking_uri, validation)
        write_summary(summary)
    if summary.pruned:  # Completed, named so the UI and the search tell it apart.
        return Completed(name="Pruned", message=f"pruned after epoch {training.epochs_completed}", data=summary)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = flow_parser(
        "pipeline",
        "CIFAR-10 from the raw archive to a served model (Prefect flow `cifar`).",
        "--source cifar-10-python.tar.gz --preset smoke --set train.epochs=3 --until evaluate",
    )
    add_run_arguments(parser, preset="default", workdir="where data, runs, exports and summary.json go")
    add = parser.add_argument
    add("--until", default="export", choices=STAGES, help="last stage to run (export includes registering)")
    add("--refresh", action="store_true", help="recompute every stage, even where finished work exists")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="continue the training run (the default)")
    resume.add_argument("--fresh", action="store_true", help="discard the run's checkpoints (train.resume=false)")
    add_set_argument(parser, "train.epochs=3")
    return parser


def check(args: argparse.Namespace) -> Request:
    """The validated config, checked against this machine; the run prints the summary's lines."""
    config = config_from_args(args)
    check_request(config)
    check_approval_reachable(config)
    overrides = ConfigOverrides.of(config)
    from prefect.settings import get_current_settings

    # Without a server, the job's other workers need a pool to be placed on: a local one for the length of the
    # run (its own server, so no temporary one). Decided here, before the supervisor starts a temporary server.
    local_pool = config.train.workers > 1 and not get_current_settings().api.url and reaches(args.until, "train")

    def run() -> int:
        arguments = {"config": overrides, "workdir": args.workdir, "until": args.until, "refresh": args.refresh}
        if local_pool:
            with local_work_pool(config.train.workers - 1, resolve_workdir(args.workdir) / "logs"):
                summary = cifar_pipeline(**arguments)
        else:
            summary = cifar_pipeline(**arguments)
        print(summary.describe())
        return 0

    return Request(resolve_workdir(args.workdir), run, temporary_server=not local_pool)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command("pipeline", build_parser(), check, argv, error_type=True)


if __name__ == "__main__":
    sys.exit(main())
