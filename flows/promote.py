"""The `cifar-promote` flow: a person moves the champion alias, with the reason on record.

    python flows/promote.py --version 7 --reason "v7 is better on the customer's data; v6 refused on noise"
    python flows/promote.py --rollback --reason "v8 misclassifies trucks in production"

Moves `models:/<model>@champion` (what `make serve` and `cifar-predict` use) to a version the gate
refused, or back to the version that held it before the current champion (a rollback). Who (the
account, or `--by`), when and why are recorded as the version's `override` tag, in the registered
model's `champion_history`, and in the flow run's report. The store is MLFLOW_TRACKING_URI, or the
workdir's own (`--workdir`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
from cifar.quiet import quiet_environment  # noqa: E402

quiet_environment()

from prefect import flow  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402

from cifar.config import TrackingConfig, resolve_workdir  # noqa: E402
from cifar.registry import promote_by_hand  # noqa: E402
from cifar.tracking import resolve_tracking_uri  # noqa: E402
from flows.pipeline import dry_run_plan  # noqa: E402


@flow(name="cifar-promote", log_prints=True)
def promote(
    reason: str,
    version: int | None = None,
    rollback: bool = False,
    model_name: str = "cifar10",
    workdir: str = "./workdir",
    by: str | None = None,
) -> dict[str, Any]:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python flows/promote.py", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", type=int, help="the registered version to make champion")
    which.add_argument("--rollback", action="store_true", help="back to the champion before the current one")
    parser.add_argument("--reason", required=True, help="why (recorded on the version and in the history)")
    parser.add_argument("--by", help="who (default: this account)")
    parser.add_argument("--model-name", default="cifar10")
    parser.add_argument("--workdir", default="./workdir", help="whose MLflow store, unless MLFLOW_TRACKING_URI is set")
    args = parser.parse_args(argv)
    try:
        record = promote(
            reason=args.reason,
            version=args.version,
            rollback=args.rollback,
            model_name=args.model_name,
            workdir=args.workdir,
            by=args.by,
        )
    except Exception as error:  # One line: the registry's answer or ours (unknown version, no earlier champion).
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(record["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
