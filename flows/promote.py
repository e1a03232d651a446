"""The `cifar-promote` flow: a person moves the champion alias, with the reason on record; and the sign-off.

    python flows/promote.py --version 7 --reason "v7 is better on the customer's data; v6 refused on noise"
    python flows/promote.py --rollback --reason "v8 misclassifies trucks in production"
    python flows/promote.py --approve RUN --reason "checked the trucks"    # RUN: a waiting flow run's id or name
    python flows/promote.py --reject RUN --reason "worse on night photos"

--approve and --reject decide for a run waiting for approval (promotion.approval=required; flows/approval.py)
on the server at PREFECT_API_URL: the decision is written to MLflow with this MLflow account (recorded as who
decided; the viewer account may not write it), then the run resumes and ends. The `cifar-approval-timeout`
flow expires a decision nobody took (scheduled by the waiting run).

Who (the account, or `--by`), when and why go on the version (tag `override`) and into the registered
model's `champion_history` (README "Continuous training"). The store is MLFLOW_TRACKING_URI, or the workdir's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # This checkout first, installed or not.

from flows.runtime import DryRunPlan, Request, dry_run_plan, run_command

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from cifar.approval import mlflow_account, waiting_for
from cifar.config import TrackingConfig, resolve_workdir
from cifar.registry import promote_by_hand
from cifar.tracking import resolve_tracking_uri
from flows.approval import apply, expire
from flows.cli import flow_parser
from tasks.events import announce_move


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
    move = {"how": record["how"], "from_version": record["previous_champion"], "to_version": record["version"],
            "by": record["by"], "reason": record["reason"], "at": record["at"]}  # fmt: skip
    announce_move(model_name, move)
    return {**record, "summary": line}


NOT_EXPIRED_YET, NOTHING_TO_EXPIRE = "Not expired yet", "Nothing to expire"  # Completed states that change nothing.


@flow(name="cifar-approval-timeout", log_prints=True)
def approval_timeout(
    flow_run_id: str, model_name: str = "cifar10", workdir: str = "./workdir", tracking_uri: str | None = None
):
    """Expires the decision `flow_run_id` waits for, if nobody took it: the champion stays; the waiting run ends.

    Started early, or with nothing waiting, it changes nothing and says so in its final state's name and message
    (NOT_EXPIRED_YET, NOTHING_TO_EXPIRE), where the UI and the API show it without reading logs.
    """
    from prefect import get_client
    from prefect.states import Completed, Failed

    plan = dry_run_plan("cifar-approval-timeout", None, workdir, flow_run_id=flow_run_id, model_name=model_name)
    if plan:
        return plan.describe()
    uri = resolve_tracking_uri(TrackingConfig(tracking_uri=tracking_uri), resolve_workdir(workdir))
    record = waiting_for(uri, model_name, flow_run_id)
    if record is None or record.state != "waiting":
        line = f"nothing to expire: {record.describe() if record else f'no version waits for flow run {flow_run_id}'}"
        print(line)
        return Completed(name=NOTHING_TO_EXPIRE, message=line, data=line)
    if datetime.now(UTC) < record.expires_at:  # Started early (by hand, or a clock ahead): not yet.
        line = f"not expired yet: {record.describe()}; expires at {record.expires_at:%Y-%m-%d %H:%M:%S} UTC"
        print(line)
        return Completed(name=NOT_EXPIRED_YET, message=line, data=line)
    decided = expire(uri, record)
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        if state is not None and state.is_paused():
            message = f"No decision in {record.timeout_hours:g} h: {decided.describe()}"
            client.set_flow_run_state(flow_run_id, Failed(message=message[:2000]), force=True)
    return decided.describe()


def find_waiting_run(client, run: str):
    """The flow run `run` names (its id, or its name), which must be waiting for a decision."""
    from uuid import UUID

    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    try:
        flow_run = client.read_flow_run(UUID(run))
    except ValueError:
        matches = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run])))
        if len(matches) != 1:
            raise ValueError(f"{len(matches)} flow runs are named {run!r}: give its id") from None
        flow_run = matches[0]
    except Exception as error:  # The server's 404.
        raise ValueError(f"no flow run {run} on {client.api_url}: {error}") from None
    if flow_run.state is None or not flow_run.state.is_paused():
        state = flow_run.state.name if flow_run.state else "none"
        raise ValueError(
            f"flow run {flow_run.name} ({flow_run.id}) is not waiting for a decision: its state is {state}"
        )
    return flow_run


def decide_from_command_line(run: str, approve: bool, reason: str, model_name: str, workdir: str) -> int:
    """--approve/--reject: the decision written with this MLflow account, then the waiting run resumed."""
    import os

    from mlflow.exceptions import MlflowException
    from prefect import get_client
    from prefect.flow_runs import resume_flow_run

    if not os.environ.get("PREFECT_API_URL"):
        raise ValueError("--approve and --reject need the server the run waits on: set PREFECT_API_URL")
    if not reason.strip():
        raise ValueError("a reason is required: it is recorded with the decision")
    with get_client(sync_client=True) as client:
        flow_run = find_waiting_run(client, run)
    tracking_uri = resolve_tracking_uri(TrackingConfig(), resolve_workdir(workdir))
    record = waiting_for(tracking_uri, model_name, str(flow_run.id))
    if record is None or record.state != "waiting":
        found = record.describe() if record else "none"
        raise ValueError(f"no {model_name} version waits for flow run {flow_run.name} in {tracking_uri} ({found})")
    account = mlflow_account()
    try:
        decided = apply(tracking_uri, record, approve, reason, account, "command line")
    except MlflowException as error:  # The viewer account: a 403 from the tracking server.
        raise ValueError(f"MLflow refused the decision of account {account!r}: {error.message}") from None
    answer = {"decision": "approve" if approve else "reject", "reason": reason.strip(), "approver": account}
    resume_flow_run(flow_run.id, run_input=answer)
    print(f"{decided.describe()}; flow run {flow_run.name} resumed")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = flow_parser("promote", __doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", type=int, help="the registered version to make champion")
    which.add_argument("--rollback", action="store_true", help="back to the champion before the current one")
    which.add_argument("--approve", metavar="RUN", help="approve what the flow run RUN (id or name) waits for")
    which.add_argument("--reject", metavar="RUN", help="reject what the flow run RUN (id or name) waits for")
    parser.add_argument("--reason", required=True, help="why (recorded on the version and in the history)")
    parser.add_argument("--by", help="who (default: this account)")
    parser.add_argument("--model-name", default="cifar10")
    parser.add_argument("--workdir", default="./workdir", help="whose MLflow store, unless MLFLOW_TRACKING_URI is set")
    return parser


def check(args: argparse.Namespace) -> Request:
    """Nothing to check before the registry answers (an unknown version, no earlier champion: one `error:` line).

    --approve/--reject answer without a flow run of their own: they act on the waiting one.
    """
    if args.approve or args.reject:
        if args.by:
            raise ValueError("--by does not apply to --approve/--reject: the MLflow account that writes it is recorded")
        run = args.approve or args.reject
        return decide_from_command_line(run, bool(args.approve), args.reason, args.model_name, args.workdir)

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
