"""The sign-off's records in a real SQLite MLflow registry: a decision applied once, the alias moved only by an
approval of a still-valid comparison, rejections in the history without confusing a rollback."""

from __future__ import annotations

import json

import pytest

from cifar.approval import APPROVAL_TAG, StaleApprovalError, decide, mark_waiting, waiting_for
from cifar.registry import CHAMPION_ALIAS, DECISION_TAG, champion_history, promote_by_hand
from cifar.results import PromotionResult
from cifar.tracking import mlflow_client

MODEL = "cifar10"


@pytest.fixture
def registry(tmp_path) -> tuple[str, object]:
    """Three versions of `cifar10` (no files needed: the records are what is tested); v1 is the champion."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow_client(uri)  # As the code under test opens it (a new store: a copy of an empty one).
    client.create_registered_model(MODEL)
    for number in (1, 2, 3):
        client.create_model_version(MODEL, source=str(tmp_path / f"model-{number}"))
    client.set_registered_model_alias(MODEL, CHAMPION_ALIAS, "1")
    return uri, client


def passed_gate(client, version: int, champion_before: int | None = 1) -> PromotionResult:
    """The gate's pass recorded on `version`, as the register stage leaves it with approval required."""
    result = PromotionResult(
        key="k",
        registered_model_version=version,
        champion=False,
        awaiting_approval=True,
        test_accuracy=0.9,
        champion_accuracy_before=0.8,
        champion_version_before=champion_before,
        reason="+10.00 points, every rule passed; awaits a person's approval",
    )
    client.set_model_version_tag(MODEL, str(version), DECISION_TAG, result.model_dump_json(exclude={"reused"}))
    return result


def champion(client) -> int:
    return int(client.get_model_version_by_alias(MODEL, CHAMPION_ALIAS).version)


def test_an_approval_moves_the_alias_once_with_the_record(registry):
    uri, client = registry
    record, marked = mark_waiting(uri, passed_gate(client, 2), MODEL, "run-a", timeout_hours=72)
    assert marked and record.state == "waiting" and champion(client) == 1
    assert mark_waiting(uri, passed_gate(client, 2), MODEL, "run-a", timeout_hours=72)[1] is False  # Resumed.
    assert waiting_for(uri, MODEL, "run-a").version == 2 and waiting_for(uri, MODEL, "run-b") is None

    decided, move = decide(uri, MODEL, 2, approve=True, reason="checked the trucks", by="alice", via="command line")
    assert champion(client) == 2 and decided.state == "approved" and decided.decided_by == "alice"
    assert move["from_version"] == 1 and move["to_version"] == 2 and move["how"] == "approval"
    assert champion_history(client, MODEL)[-1] | {"at": None} == {
        "version": 2, "at": None, "by": "alice", "how": "approval", "reason": "checked the trucks"}  # fmt: skip
    decision = PromotionResult.model_validate_json(client.get_model_version(MODEL, "2").tags[DECISION_TAG])
    assert decision.champion and not decision.awaiting_approval
    assert decision.reason.endswith("approved by alice (command line): checked the trucks")

    # The resumed run applies the form's answer too: the first decision stands, nothing moves twice.
    again, move = decide(uri, MODEL, 2, approve=False, reason="late", by="bob", via="form")
    assert move is None and again.state == "approved" and len(champion_history(client, MODEL)) == 1


def test_a_rejection_leaves_the_champion_and_a_rollback_ignores_it(registry):
    uri, client = registry
    promote_by_hand(uri, MODEL, 1, "the first champion, on record")
    mark_waiting(uri, passed_gate(client, 3), MODEL, "run-b", timeout_hours=72)
    decided, move = decide(uri, MODEL, 3, approve=False, reason="worse at night", by="bob", via="form")
    assert move is None and champion(client) == 1 and decided.state == "rejected"
    assert json.loads(client.get_model_version(MODEL, "3").tags[APPROVAL_TAG])["reason"] == "worse at night"
    rejected = {"version": 3, "at": None, "by": "bob", "how": "rejected", "reason": "worse at night", "moved": False}
    assert champion_history(client, MODEL)[-1] | {"at": None} == rejected
    mark_waiting(uri, passed_gate(client, 2), MODEL, "run-a", timeout_hours=72)
    decide(uri, MODEL, 2, approve=True, reason="fine", by="alice", via="form")
    # Back to the champion before v2: v1, not v3 (in the history after v1, but rejected: never champion).
    assert promote_by_hand(uri, MODEL, None, "roll back", rollback=True)["version"] == 1


def test_an_approval_after_the_champion_moved_is_refused_and_a_reason_is_required(registry):
    uri, client = registry
    mark_waiting(uri, passed_gate(client, 3), MODEL, "run-c", timeout_hours=72)
    with pytest.raises(ValueError, match="reason is required"):
        decide(uri, MODEL, 3, approve=True, reason="  ", by="alice", via="form")
    promote_by_hand(uri, MODEL, 2, "hotfix")  # The champion moves while v3 waits.
    with pytest.raises(StaleApprovalError, match="moved from v1 to v2"):
        decide(uri, MODEL, 3, approve=True, reason="ok", by="alice", via="command line")
    assert champion(client) == 2
    with pytest.raises(ValueError, match="not waiting for approval"):
        decide(uri, MODEL, 1, approve=True, reason="ok", by="alice", via="form")
