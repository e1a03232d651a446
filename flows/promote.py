"""The `cifar-promote` flow: a person moves the champion alias, with the reason on record.

    python flows/promote.py --version 7 --reason "v7 is better on the customer's data; v6 refused on noise"
    python flows/promote.py --rollback --reason "v8 misclassifies trucks in production"

Who (the account, or `--by`), when and why go on the version (tag `override`) and into the registered
model's `champion_history` (README "Continuous training"). The store is MLFLOW_TRACKING_URI, or the workdir's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # This checkout first, installed or not.

from flows.runtime import DryRunPlan, Request, dry_run_plan, run_command

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from cifar.config import TrackingConfig, resolve_workdir
from cifar.registry import promote_by_hand
from cifar.tracking import resolve_tracking_uri
from flows.cli import flow_parser


@flow(name="cifar-promote", log_prints=True)
def promote(
    reason: str,
    version: int | None = None,
    rollback: bool = False,
    model_name: str = "cifar10",
    workdir: str = "./workdir",
    by: str | None = None,
) -> dict[str, Any] | DryRunPlan:
    """Moves the champion alias to `version`, or back to the previous champion with `rollback`; `reason` is required."""
    plan = dry_run_plan("cifar-promote", None, workdir, version=version, rollback=rollback, reason=reason)
    if plan:
        return plan
    tracking_uri = resolve_tracking_uri(TrackingConfig(), resolve_workdir(workdir))
    record = promote_by_hand(tracking_uri, model_name, version, reason, rollback=rollback, by=by)
    line = (
        f"{record['how']}: {model_name}@champion v{record['previous_champion']} -> v{record['version']} "
        f"by {record['by']} at {record['at']}: {record['reason']}"
    )
    print(line)
    create_markdown_artifact(f"# Champion moved by hand\n\n{line}\n", key="cifar-promote")
    return {**record, "summary": line}


def build_parser() -> argparse.ArgumentParser:
    parser = flow_parser("promote", __doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", type=int, help="the registered version to make champion")
    which.add_argument("--rollback", action="store_true", help="back to the champion before the current one")
    parser.add_argument("--reason", required=True, help="why (recorded on the version and in the history)")
    parser.add_argument("--by", help="who (default: this account)")
    parser.add_argument("--model-name", default="cifar10")
    parser.add_argument("--workdir", default="./workdir", help="whose MLflow store, unless MLFLOW_TRACKING_URI is set")
    return parser


def check(args: argparse.Namespace) -> Request:
    """Nothing to check before the registry answers (an unknown version, no earlier champion: one `error:` line)."""

    def run() -> int:
        record = promote(
            reason=args.reason,
            version=args.version,
            rollback=args.rollback,
            model_name=args.model_name,
            workdir=args.workdir,
            by=args.by,
        )
        print(record["summary"])
        return 0

    return Request(resolve_workdir(args.workdir), run)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command("promote", build_parser(), check, argv)


if __name__ == "__main__":
    sys.exit(main())
