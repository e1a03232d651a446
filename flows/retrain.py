"""The `cifar-retrain` flow: retrain on the latest data when something changed, judge the challenger, promote.

    python flows/retrain.py --preset smoke --workdir W [--force] [--set ...]
    prefect deployment run cifar-retrain/nightly          # at 02:00 UTC, and after every burst of new data

It first works out what a retrain would use: the workdir's latest data snapshot, the config, the code
(their training key, cifar.retraining). When a registered version was trained under that key (the
champion, or a challenger the gate refused), it ends in seconds as "Nothing changed" (the flow run's
state, its report and its log say so): no training, no MLflow run. Otherwise it says what changed and
runs the pipeline: the challenger trains into the run directory of its own key, and the register stage
compares it with the champion on the same test images (cifar.comparison) before moving the alias.
`force` retrains anyway, with a new seed, and says so.

Without `data.source` in the config, the archive is the one the workdir's snapshots extend (the
preset's default only for a workdir with no data yet), so a trigger that hands over a workdir retrains
on that workdir's data. The deployment's trigger (prefect.yaml) listens to `cifar.data.added`, which
`cifar-ingest` emits; the `training` tag limit keeps two trainings off one device.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
from cifar.quiet import quiet_environment  # noqa: E402

quiet_environment()

from prefect import flow, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402
from prefect.states import Completed  # noqa: E402

from cifar.config import ConfigOverrides, PipelineConfig, resolve_workdir  # noqa: E402
from cifar.data.snapshots import workdir_base  # noqa: E402
from cifar.preflight import check_request  # noqa: E402
from cifar.results import ArchiveInfo  # noqa: E402
from cifar.retraining import RetrainPlan, plan_retrain  # noqa: E402
from cifar.tracking import resolve_tracking_uri  # noqa: E402
from flows.pipeline import cifar_pipeline, dry_run_plan, show_stage_logs  # noqa: E402
from tasks.artifacts import write_summary  # noqa: E402
from tasks.data import download_archive  # noqa: E402

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


def retrain_markdown(plan: RetrainPlan, summary: dict[str, Any] | None, *, force: bool, seed: int) -> str:
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
    if summary and summary.get("registered_model_version") is not None:
        verdict = "promoted to champion" if summary.get("champion") else "not promoted"
        rows.append(("Challenger", f"v{summary['registered_model_version']}, {verdict}: {summary['promotion_reason']}"))
    lines += ["| | |", "|---|---|", *[f"| {name} | {value} |" for name, value in rows]]
    return "\n".join(lines) + "\n"


def human_flow_run_name() -> str:
    overrides = flow_run.parameters.get("config")
    try:
        config = ConfigOverrides.model_validate(overrides or {}).resolve()
    except ValueError:
        return "retrain-invalid-config"
    return f"retrain-{config.preset}-{config.train.model}"


@flow(name="cifar-retrain", log_prints=True, flow_run_name=human_flow_run_name)
def retrain(
    config: ConfigOverrides = ConfigOverrides(preset="full"), workdir: str = "./workdir", force: bool = False
) -> Any:
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
    archive = download_archive(config, workdir)
    retraining = plan_retrain_task(config, archive, workdir)
    if retraining.nothing_changed and not force:
        print(retraining.summary)
        create_markdown_artifact(retrain_markdown(retraining, None, force=force, seed=config.seed), key="cifar-retrain")
        return Completed(name=NOTHING_CHANGED, message=retraining.summary, data=retraining.model_dump())
    print(f"Forced retrain with seed {config.seed}; {retraining.summary}" if force else retraining.summary.capitalize())
    summary = cifar_pipeline(config=ConfigOverrides.of(config), workdir=workdir, until="export")
    summary["retrain"] = retraining.model_dump()
    summary["summary_path"] = write_summary(summary, workdir)  # With what changed, beside what it made.
    create_markdown_artifact(retrain_markdown(retraining, summary, force=force, seed=config.seed), key="cifar-retrain")
    verdict = "champion" if summary.get("champion") else "not promoted"
    print(
        f"Retrained on snapshot {retraining.snapshot}: challenger v{summary.get('registered_model_version')} "
        f"{verdict} ({summary.get('promotion_reason')})"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    from flows.cli import SUPERVISED_ENV, add_archive_arguments, config_from_args, prepare_ephemeral_database, supervise

    parser = argparse.ArgumentParser(prog="python flows/retrain.py", description="Retrain when something changed.")
    add_archive_arguments(parser)
    parser.add_argument("--workdir", default="./workdir")
    parser.add_argument("--preset", default="full")
    parser.add_argument("--force", action="store_true", help="retrain even when nothing changed (a new seed)")
    parser.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE")
    parser.set_defaults(fresh=False)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if os.environ.get(SUPERVISED_ENV) != "1" and sys.platform == "linux":
        prepare_ephemeral_database()
        return supervise(sys.argv[1:] if argv is None else list(argv), script="retrain.py")
    overrides = ConfigOverrides.of(config)
    if args.source is None:  # Let the flow take the workdir's archive.
        overrides = overrides.model_copy(update={"data": overrides.data.model_copy(update={"source": None})})
    state = retrain(config=overrides, workdir=args.workdir, force=args.force, return_state=True)
    return 0 if state.is_completed() else 1


if __name__ == "__main__":
    sys.exit(main())
