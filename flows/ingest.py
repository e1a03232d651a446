"""The `cifar-ingest` flow: new labelled data into the workdir's data store, through the validation gate.

    python flows/ingest.py --add PATH [--workdir W] [--resize bilinear] [--set validate.enforce=false]
    python flows/ingest.py --list [--workdir W]
    python flows/ingest.py --remove DIGEST [--workdir W]

PATH is a CIFAR batch file (the pickle layout of `data_batch_N`) or a folder of PNG/JPEG images in
class-named subfolders (`cat/001.png`). The base archive is the latest snapshot's (or `--source` and
`--sha256`, like the pipeline's). An addition that passes the gate is stored under its digest and the
latest snapshot plus it becomes the new latest snapshot, which the next pipeline run trains on; the
flow then emits the Prefect event `cifar.data.added` (the retrain deployment's trigger listens to
it). One that fails is refused with one line naming the failed checks; the store is unchanged and
the full report is kept under WORKDIR/data/rejected/.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
from cifar.quiet import quiet_environment  # noqa: E402

quiet_environment()

from prefect import flow, task  # noqa: E402
from prefect.events import emit_event  # noqa: E402

from cifar.champion import find_champion  # noqa: E402
from cifar.config import ConfigOverrides, PipelineConfig, resolve_workdir  # noqa: E402
from cifar.data.additions import RESIZE_METHODS  # noqa: E402
from cifar.data.download import fetch_archive  # noqa: E402
from cifar.data.gate_checks import DataValidationError  # noqa: E402
from cifar.data.ingest import IngestResult, describe_snapshots, ingest_addition, remove_addition  # noqa: E402
from cifar.data.snapshots import DataStore, workdir_base  # noqa: E402
from cifar.results import ArchiveInfo  # noqa: E402
from cifar.tracking import resolve_tracking_uri  # noqa: E402
from cifar.workdir import downloads_dir  # noqa: E402
from flows.pipeline import dry_run_plan  # noqa: E402
from tasks.data_gate import publish_validation  # noqa: E402

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
) -> dict[str, Any]:
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
    return result.model_dump()


def build_parser() -> argparse.ArgumentParser:
    from flows.cli import add_archive_arguments

    parser = argparse.ArgumentParser(
        prog="python flows/ingest.py",
        description="Add labelled data to the workdir's data store as a new snapshot (Prefect flow `cifar-ingest`).",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--add", metavar="PATH", help="a CIFAR batch file, or a folder of <class>/<image> files")
    action.add_argument("--list", action="store_true", help="list the snapshots and what each adds")
    action.add_argument("--remove", metavar="DIGEST", help="record the latest snapshot without this addition")
    add_archive_arguments(parser)
    parser.add_argument("--workdir", default="./workdir", help="the workdir whose data store to change")
    parser.add_argument("--resize", choices=RESIZE_METHODS, help="resize images of another size (recorded)")
    help_set = "override one config field, e.g. --set validate.enforce=false (repeatable; values parse as JSON)"
    parser.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help=help_set)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from flows.cli import SUPERVISED_ENV, log_to_file, overrides_from_args, prepare_ephemeral_database, supervise

    args = build_parser().parse_args(argv)
    try:
        overrides = overrides_from_args(args)
        workdir = resolve_workdir(args.workdir)
        if args.list:
            print(describe_snapshots(workdir))
            return 0
        if args.remove:
            config = overrides.resolve()
            result = remove_addition(workdir, base_archive(config, overrides, workdir), args.remove)
            print(result.summary)
            return 0
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if os.environ.get(SUPERVISED_ENV) != "1" and sys.platform == "linux":
        prepare_ephemeral_database()
        return supervise(sys.argv[1:] if argv is None else list(argv), script="ingest.py")
    log_path = log_to_file(workdir, "ingest")
    try:
        summary = ingest(path=args.add, workdir=str(workdir), config=overrides, resize=args.resize)
    except Exception as error:
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(traceback.format_exc())
        print(f"error: {error} (full log: {log_path})", file=sys.stderr)
        return 1
    print(summary["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
