"""The `cifar-retrain` flow: retrain on the latest data when something changed, judge the challenger, promote.

    python flows/retrain.py --preset smoke --workdir W [--force] [--set ...]
    prefect deployment run cifar-retrain/nightly          # at 02:00 UTC, and after every burst of new data

How it decides, and its trigger: README "Continuous training" and docs/ORCHESTRATION.md.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # This checkout first, installed or not.

from flows.runtime import DryRunPlan, Request, dry_run_plan, named_by_config, run_command, show_stage_logs

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, State

from cifar.config import ConfigOverrides, PipelineConfig, resolve_workdir
from cifar.data.snapshots import workdir_base
from cifar.preflight import check_request
from cifar.results import ArchiveInfo, RetrainPlan
from cifar.retraining import plan_retrain
from cifar.summary import PipelineSummary
from cifar.tracking import resolve_tracking_uri
from flows.approval import check_approval_reachable, pending_decision, resume_with_decision, wait_for_approval
from flows.cli import add_run_arguments, add_set_argument, config_from_args, flow_parser
from flows.pipeline import cifar_pipeline
from tasks.artifacts import write_summary
from tasks.data import download_archive

NOTHING_CHANGED = "Nothing changed"  # The Completed state's name when no retrain was needed.


def retrain_config(overrides: ConfigOverrides, workdir: str, *, force: bool) -> PipelineConfig:
    """The resolved config: the workdir's archive unless one was given; with `force`, a fresh seed."""
    config = overrides.resolve()
    if overrides.data.source is None:
        config = config.model_copy(update={"data": workdir_base(config.data, workdir)})
    if force:
        config = config.model_copy(update={"seed": secrets.randbelow(2**31)})
    return config


@task(name="plan-retrain")
def plan_retrain_task(config: PipelineConfig, archive: ArchiveInfo, workdir: str) -> RetrainPlan:
    """What a retrain would use, and whether a version was already trained and judged on exactly that."""
    return plan_retrain(config, archive, workdir, resolve_tracking_uri(config.tracking, workdir))


def retrain_markdown(plan: RetrainPlan, summary: PipelineSummary | None, *, force: bool, seed: int) -> str:
    lines = [f"# Retrain: {NOTHING_CHANGED.lower() if plan.nothing_changed else 'challenger trained'}", ""]
    lines += [plan.summary, ""]
    rows = [
        ("Data snapshot", f"{plan.snapshot} ({plan.additions} additions)"),
        ("Training key", plan.training_key),
        ("Champion before", f"v{plan.champion_version}" if plan.champion_version else "none"),
        ("Forced (new seed)", f"yes, seed {seed}" if force else "no"),
    ]
    if plan.changes:
        rows.append(("What changed", "<br>".join(plan.changes)))
    promotion = summary and summary.promotion
    if promotion and promotion.registered_model_version is not None:
        verdict = "promoted to champion" if promotion.champion else "not promoted"
        rows.append(("Challenger", f"v{promotion.registered_model_version}, {verdict}: {promotion.reason}"))
    lines += ["| | |", "|---|---|", *[f"| {name} | {value} |" for name, value in rows]]
    return "\n".join(lines) + "\n"


def retrain_run_name(config: PipelineConfig) -> str:
    return f"retrain-{config.preset}-{config.train.model}"


@flow(name="cifar-retrain", log_prints=True, flow_run_name=named_by_config(retrain_run_name, "retrain-invalid-config"))
def retrain(
    config: ConfigOverrides = ConfigOverrides(preset="full"), workdir: str = "./workdir", force: bool = False
) -> PipelineSummary | DryRunPlan | State:
    """Retrains on the workdir's latest data only when something changed; the gate judges the challenger.

    `force` retrains even when nothing changed, with a new seed.
    """
    show_stage_logs()
    overrides = config
    plan = dry_run_plan("cifar-retrain", overrides.resolve(), workdir, force=force)  # The form's config.
    if plan:
        return plan
    workdir = str(resolve_workdir(workdir))
    config = retrain_config(overrides, workdir, force=force)
    check_request(config)
    tracking_uri = resolve_tracking_uri(config.tracking, workdir)
    if (waiting := pending_decision(config, tracking_uri)) is not None:  # Resumed with a decision: no training.
        decided = resume_with_decision(waiting, tracking_uri)
        return Completed(name=decided.state.capitalize(), message=decided.describe(), data=decided.model_dump())
    archive = download_archive(config, workdir)
    retraining = plan_retrain_task(config, archive, workdir)
    if retraining.nothing_changed and not force:
        print(retraining.summary)
        create_markdown_artifact(retrain_markdown(retraining, None, force=force, seed=config.seed), key="cifar-retrain")
        return Completed(name=NOTHING_CHANGED, message=retraining.summary, data=retraining.model_dump())
    print(f"Forced retrain with seed {config.seed}; {retraining.summary}" if force else retraining.summary.capitalize())
    summary = cifar_pipeline(config=ConfigOverrides.of(config), workdir=workdir, until="export")
    summary.retrain = retraining
    write_summary(summary)  # With what changed, beside what it made.
    create_markdown_artifact(retrain_markdown(retraining, summary, force=force, seed=config.seed), key="cifar-retrain")
    promotion = summary.promotion
    if promotion and promotion.awaiting_approval:  # Suspends here (a deployment's run) until a person decides.
        summary.approval = wait_for_approval(config, promotion, tracking_uri, summary.validation)
        write_summary(summary)
        return Completed(name=summary.approval.state.capitalize(), message=summary.approval.describe(), data=summary)
    verdict = "champion" if promotion and promotion.champion else "not promoted"
    print(
        f"Retrained on snapshot {retraining.snapshot}: challenger v{promotion and promotion.registered_model_version} "
        f"{verdict} ({promotion and promotion.reason})"
    )
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = flow_parser("retrain", "Retrain when something changed.")
    add_run_arguments(parser, preset="full", workdir="the workdir to retrain on")
    parser.add_argument("--force", action="store_true", help="retrain even when nothing changed (a new seed)")
    add_set_argument(parser, "train.epochs=3")
    parser.set_defaults(fresh=False)
    return parser


def check(args: argparse.Namespace) -> Request:
    """The validated config; without --source the flow takes the workdir's archive."""
    overrides = ConfigOverrides.of(config_from_args(args))
    check_approval_reachable(overrides.resolve())
    if args.source is None:
        overrides = overrides.model_copy(update={"data": overrides.data.model_copy(update={"source": None})})

    def run() -> int:
        state = retrain(config=overrides, workdir=args.workdir, force=args.force, return_state=True)
        return 0 if state.is_completed() else 1

    return Request(resolve_workdir(args.workdir), run)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command("retrain", build_parser(), check, argv)


if __name__ == "__main__":
    sys.exit(main())
