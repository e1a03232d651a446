"""A person's sign-off on a challenger the gate passed (`promotion.approval: required`).

The gate records its pass on the version (`promotion` tag, `awaiting_approval`) without moving the alias;
the run that registered it marks the version waiting (`approval` tag: which flow run waits, since when, on
which champion) and waits for a decision: Prefect's form on that run, or `flows/promote.py --approve/--reject`.
`decide` applies it once: an approval moves the alias (`champion_history`, how "approval"); a rejection, or
no decision in time, leaves the champion where it is, with the why on the version and in the history
(`moved` false). A decision taken twice (the command line, then the resumed run) is applied once.

Who decided: the form's approver is the name a person types (Prefect's open-source server signs everyone
in with one shared credential, so it proves nothing about who that was); the command line records the
MLflow account that wrote the decision, which the tracking server's authentication did check (a viewer
cannot write it). Only MLflow here, not Prefect or TensorFlow.
"""

from __future__ import annotations

import getpass
import os
from datetime import UTC, datetime

from cifar.champion import CHAMPION_ALIAS, find_champion
from cifar.registry import DECISION_TAG, append_history
from cifar.results import ApprovalRecord, PromotionResult, Via
from cifar.tracking import mlflow_client

APPROVAL_TAG = "approval"  # On a version the gate passed with approval required: an ApprovalRecord (JSON).
WAITING_RUN_TAG = "approval_flow_run"  # The flow run waiting for the decision (searchable, unlike JSON).


class StaleApprovalError(ValueError):
    """The champion moved since the gate compared the challenger with it: the comparison no longer holds."""


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def mlflow_account() -> str:
    """Who writes to the tracking store: the MLflow account (MLFLOW_TRACKING_USERNAME), else this OS user."""
    if name := os.environ.get("MLFLOW_TRACKING_USERNAME"):
        return name
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # No name for this uid (a container).
        return "unknown"


def read_record(client, model_name: str, version: int) -> ApprovalRecord | None:
    tags = client.get_model_version(model_name, str(version)).tags
    return ApprovalRecord.model_validate_json(tags[APPROVAL_TAG]) if APPROVAL_TAG in tags else None


def mark_waiting(
    tracking_uri: str, promotion: PromotionResult, model_name: str, flow_run_id: str | None, timeout_hours: float
) -> tuple[ApprovalRecord, bool]:
    """Marks the version waiting for `flow_run_id`; (the record, whether it was marked now). Idempotent: a
    resumed run finds its own mark (and the decision, once taken)."""
    client = mlflow_client(tracking_uri)
    version = int(promotion.registered_model_version)
    existing = read_record(client, model_name, version)
    if existing is not None:
        return existing, False
    record = ApprovalRecord(
        model_name=model_name,
        version=version,
        state="waiting",
        flow_run_id=flow_run_id,
        champion_version_before=promotion.champion_version_before,
        waiting_since=now(),
        timeout_hours=timeout_hours,
    )
    _write(client, record)
    return record, True


def waiting_for(tracking_uri: str, model_name: str, flow_run_id: str) -> ApprovalRecord | None:
    """The version `flow_run_id` waits (or waited) for a decision on, or None."""
    from mlflow.exceptions import MlflowException

    client = mlflow_client(tracking_uri)
    try:
        versions = client.search_model_versions(f"name = '{model_name}' and tags.{WAITING_RUN_TAG} = '{flow_run_id}'")
    except MlflowException:
        return None
    newest = max(versions, key=lambda version: int(version.version), default=None)
    return read_record(client, model_name, int(newest.version)) if newest is not None else None


def decide(
    tracking_uri: str, model_name: str, version: int, *, approve: bool, reason: str, by: str, via: Via
) -> tuple[ApprovalRecord, dict | None]:
    """Applies a decision on a waiting version; returns (the record, the alias move made now, or None).

    An approval moves the alias to the version if the champion is still the one it was compared with
    (StaleApprovalError otherwise); a rejection or an expiry only records why. A version already decided
    keeps its first decision (returned, with no move).
    """
    reason = reason.strip()
    if not reason:
        raise ValueError("a reason is required: it is recorded with the decision for whoever reads the registry")
    if not by.strip():
        raise ValueError("who decides is required (the approver's name)")
    client = mlflow_client(tracking_uri)
    record = read_record(client, model_name, version)
    if record is None:
        raise ValueError(f"{model_name} v{version} is not waiting for approval (the gate did not ask for it)")
    if record.state != "waiting":
        return record, None
    state = "approved" if approve else ("expired" if via == "timeout" else "rejected")
    if approve:
        current = find_champion(tracking_uri, model_name)
        current_version = current.version if current else None
        if current_version != record.champion_version_before:
            raise StaleApprovalError(
                f"the champion moved from v{record.champion_version_before} to v{current_version} since the gate "
                f"compared v{version} with it: reject this one and retrain (force) to judge it against "
                f"v{current_version}"
            )
    decided = record.model_copy(
        update={"state": state, "decided_at": now(), "decided_by": by, "via": via, "reason": reason}
    )
    move = None
    if approve:
        client.set_registered_model_alias(model_name, CHAMPION_ALIAS, str(version))
        move = {"how": "approval", "from_version": record.champion_version_before, "to_version": version,
                "by": by, "via": via, "reason": reason, "at": decided.decided_at}  # fmt: skip
    append_history(
        client, model_name, version, how="approval" if approve else state, reason=reason, by=by, moved=approve
    )
    _write(client, decided)
    _record_on_decision(client, model_name, version, decided)
    return decided, move


def _write(client, record: ApprovalRecord) -> None:
    version = str(record.version)
    client.set_model_version_tag(record.model_name, version, APPROVAL_TAG, record.model_dump_json())
    if record.flow_run_id:
        client.set_model_version_tag(record.model_name, version, WAITING_RUN_TAG, record.flow_run_id)


def _record_on_decision(client, model_name: str, version: int, record: ApprovalRecord) -> None:
    """The gate's recorded decision (what a retrain's plan and the summary read) now says what the person did."""
    tags = client.get_model_version(model_name, str(version)).tags
    if DECISION_TAG not in tags:
        return
    decision = PromotionResult.model_validate_json(tags[DECISION_TAG])
    base = decision.reason.removesuffix("; awaits a person's approval")
    updated = decision.model_copy(
        update={
            "champion": record.state == "approved",
            "awaiting_approval": False,
            "reason": f"{base}; {record.state} by {record.decided_by} ({record.via}): {record.reason}",
        }
    )
    client.set_model_version_tag(model_name, str(version), DECISION_TAG, updated.model_dump_json(exclude={"reused"}))
