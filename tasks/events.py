"""The release loop's Prefect events, for automations to notify on (flows/automations.py).

    cifar.approval.waiting   a challenger passed the gate and waits for a person (payload: the run to open)
    cifar.champion.moved     the champion alias moved: how (gate, approval, override, rollback), from, to

Each event's id is derived from what it announces, so the same announcement sent again (a retried
task, a resumed run) is the same event, which Prefect's triggers count once. Sending never fails the
caller: without an API the event is logged and dropped.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

logger = logging.getLogger(__name__)

WAITING_EVENT = "cifar.approval.waiting"
MOVED_EVENT = "cifar.champion.moved"
NAMESPACE = uuid.UUID("8d3c8f3e-5b7a-4f0e-9a55-6b0a4c1b2e10")  # Event ids: uuid5 of what is announced.


def model_resource(model_name: str, version: int) -> dict[str, str]:
    return {
        "prefect.resource.id": f"cifar.model.{model_name}.v{version}",
        "prefect.resource.name": f"{model_name} v{version}",
    }


def send(event: str, resource: dict[str, str], payload: dict[str, Any], identity: str) -> bool:
    """Emits `event` with an id derived from `identity`; whether it was handed to Prefect."""
    from prefect.events import emit_event

    try:
        sent = emit_event(
            event=event, resource=resource, payload=payload, id=uuid.uuid5(NAMESPACE, f"{event}:{identity}")
        )
    except Exception as error:  # noqa: BLE001 - a notification must never fail the run that moved the model.
        logger.warning("could not send %s: %s", event, error)
        return False
    return sent is not None


def announce_waiting(model_name: str, version: int, flow_run_id: str, payload: dict[str, Any]) -> bool:
    """`cifar.approval.waiting` for `version`, waiting in `flow_run_id`."""
    body = {"model": model_name, "version": version, "flow_run_id": flow_run_id, **payload}
    return send(WAITING_EVENT, model_resource(model_name, version), body, f"{model_name}:{version}:{flow_run_id}")


def announce_move(model_name: str, move: dict[str, Any]) -> bool:
    """`cifar.champion.moved`: `move` has how, from_version, to_version, by, reason and at."""
    # The gate and an approval move the alias to a version once; a person may override or roll back repeatedly.
    once = move["how"] in ("gate", "approval")
    identity = f"{model_name}:{move['to_version']}:{move['how']}" + ("" if once else f":{move['at']}")
    payload = {"model": model_name, **move}
    return send(MOVED_EVENT, model_resource(model_name, int(move["to_version"])), payload, identity)
