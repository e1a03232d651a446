"""The `cifar-ingest` flow: new labelled data into the workdir's data store, through the validation gate.

    python flows/ingest.py --add PATH [--workdir W] [--resize bilinear] [--set validate.enforce=false]
    python flows/ingest.py --list [--workdir W]
    python flows/ingest.py --remove DIGEST [--workdir W]

What PATH may be, the gate and the `cifar.data.added` event: README "New data" and docs/DATA.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # This checkout first, installed or not.

from flows.runtime import DryRunPlan, Request, dry_run_plan, run_command

from prefect import flow, task
from prefect.events import emit_event

from cifar.champion import find_champion
from cifar.config import ConfigOverrides, PipelineConfig, resolve_workdir
from cifar.data.additions import RESIZE_METHODS
from cifar.data.download import fetch_archive
from cifar.data.gate_checks import DataValidationError
from cifar.data.ingest import IngestResult, describe_snapshots, ingest_addition, remove_addition
from cifar.data.snapshots import DataStore, workdir_base
from cifar.results import ArchiveInfo
from cifar.tracking import resolve_tracking_uri
from cifar.workdir import downloads_dir
from flows.cli import add_archive_arguments, add_set_argument, flow_parser, overrides_from_args
from tasks.data_gate import publish_validation

DATA_ADDED_EVENT = "cifar.data.added"  # prefect.yaml's retrain trigger expects this name.
ResizeMethod = Literal["bilinear", "bicubic", "lanczos", "box", "nearest"]


def base_archive(config: PipelineConfig, overrides: ConfigOverrides, workdir: Path) -> ArchiveInfo:
    """The verified base archive: the one given, else the base of the workdir's newest snapshot."""
    data = config.data
    if overrides.data.source is None:
        if DataStore(workdir).newest_base() is None:
            raise ValueError(
                f"no data snapshot in {workdir} yet: give the base archive (--source and --sha256), "
                "or run the pipeline once"
            )
        data = workdir_base(data, workdir)
    return fetch_archive(
        data.source, downloads_dir(workdir), sha256=data.sha256, md5=data.expected_md5(), retries=data.download_retries
    )


@task(name="ingest")
def ingest_task(
    config: PipelineConfig, path: str, workdir: str, archive: ArchiveInfo, resize: str | None
) -> IngestResult:
    """Reads, validates and stores the addition; records the new latest snapshot."""
    champion = find_champion(resolve_tracking_uri(config.tracking, workdir), config.export.model_name)
    try:
        result, report = ingest_addition(config, path, workdir, archive, champion, resize=resize)
    except DataValidationError as error:
        publish_validation(error.report, error.report_path or "")
        raise
    if report is not None:
        publish_validation(report, result.report_path or "")
    return result


def emit_data_added(result: IngestResult, workdir: str, archive: ArchiveInfo) -> None:
    """The `cifar.data.added` event: which snapshot is new, for automations (the retrain trigger)."""
    emit_event(
        event=DATA_ADDED_EVENT,
        resource={"prefect.resource.id": f"cifar.snapshot.{result.snapshot}", "prefect.resource.name": result.snapshot},
        payload={
            "snapshot": result.snapshot,
            "previous": result.previous,
            "addition": result.addition,
            "examples": result.examples,
            "workdir": workdir,
            "base_sha256": archive.sha256,
        },
    )


@flow(name="cifar-ingest", log_prints=True)
def ingest(
    path: str,
    workdir: str = "./workdir",
    config: ConfigOverrides = ConfigOverrides(),
    resize: ResizeMethod | None = None,
) -> IngestResult | DryRunPlan:
    """Adds labelled data (a CIFAR batch file or a folder of class-named subfolders) as a new data snapshot.

    `config` gives the base archive (data.source, data.sha256; default: the workdir's latest snapshot's)
    and the gate's thresholds (validate.*). `resize` opts into resizing images of another size.
    """
    overrides = config
    config = overrides.resolve()
    plan = dry_run_plan("cifar-ingest", config, workdir, path=path, resize=resize)
    if plan:
        return plan
    workdir = str(resolve_workdir(workdir))
    archive = base_archive(config, overrides, Path(workdir))
    result = ingest_task(config, path, workdir, archive, resize)
    if result.changed:
        emit_data_added(result, workdir, archive)
    print(f"Ingest: {result.summary}")
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = flow_parser(
        "ingest", "Add labelled data to the workdir's data store as a new snapshot (Prefect flow `cifar-ingest`)."
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--add", metavar="PATH", help="a CIFAR batch file, or a folder of <class>/<image> files")
    action.add_argument("--list", action="store_true", help="list the snapshots and what each adds")
    action.add_argument("--remove", metavar="DIGEST", help="record the latest snapshot without this addition")
    add_archive_arguments(parser)
    parser.add_argument("--workdir", default="./workdir", help="the workdir whose data store to change")
    parser.add_argument("--resize", choices=RESIZE_METHODS, help="resize images of another size (recorded)")
    add_set_argument(parser, "validate.enforce=false")
    return parser


def check(args: argparse.Namespace) -> Request | int:
    """The validated overrides; --list and --remove answer here, without a flow run."""
    overrides = overrides_from_args(args)
    workdir = resolve_workdir(args.workdir)
    if args.list:
        print(describe_snapshots(workdir))
        return 0
    if args.remove:
        result = remove_addition(workdir, base_archive(overrides.resolve(), overrides, workdir), args.remove)
        print(result.summary)
        return 0

    def run() -> int:
        result = ingest(path=args.add, workdir=str(workdir), config=overrides, resize=args.resize)
        print(result.summary)
        return 0

    return Request(workdir, run)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command("ingest", build_parser(), check, argv)


if __name__ == "__main__":
    sys.exit(main())
