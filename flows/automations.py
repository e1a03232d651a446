"""The automations the project keeps on a Prefect server: who hears of what, and the crash rule of the stack.

    python flows/automations.py                          # `make deploy` runs it; safe to run again
    python flows/automations.py --crashed-after 90       # the stack's worker (docker/entrypoint.sh)

Each is created, or updated to this definition when it exists (one of each name). The notifications
(named "cifar: notify ..."), each through the notification block named `cifar-notify`:

    an approval is waiting         cifar.approval.waiting (tasks/events.py), with the link to the form
    the champion moved             cifar.champion.moved: how (gate, approval, override, rollback), from, to
    a deployment's run failed      prefect.flow-run.Failed / Crashed of any run of a deployment
    batch prediction saw drift     cifar.drift.detected (flows/predict.py)
    the endpoint refused a version cifar.serving.version.refused (flows/serve.py)

The block: with CIFAR_NOTIFY_WEBHOOK_URL (or CIFAR_NOTIFY_WEBHOOK_URL_FILE, a file holding it) a Custom
Webhook block posting Slack's body, `{"text": ...}` (Slack's incoming webhooks, Mattermost, Rocket.Chat and
Teams' Slack-compatible hooks read it); the URL is kept among the block's secrets, never in a log,
parameter or tag. Without either, a block named `cifar-notify` that you made yourself (Prefect's Slack
Webhook, Email, Microsoft Teams, ... in the UI's Blocks page) is used; with neither, nothing is created.
Exactly once: Prefect counts an event once by its id, and our events' ids are derived from what they
announce (a retried task sends the same event again); a flow run reaches Failed once.

With --crashed-after SECONDS (workers whose flow runs send heartbeats: PREFECT_FLOWS_HEARTBEAT_FREQUENCY),
"cifar: crash flow runs whose heartbeats stopped": a flow run whose process died with its container
(killed, evicted, out of memory, the machine lost) reports nothing more and would stay RUNNING forever; with
no heartbeat and no final state for that long it is marked CRASHED, and a new run of it resumes from its
last checkpoint (Prefect's recipe, "Detect zombie flows"). A run waiting for approval, suspended, sends no
heartbeats and is not a zombie. The final states include our Completed states' own names.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

BLOCK_NAME = "cifar-notify"
URL_ENV, URL_FILE_ENV = "CIFAR_NOTIFY_WEBHOOK_URL", "CIFAR_NOTIFY_WEBHOOK_URL_FILE"
PREFIX = "cifar: notify "

# name -> (events expected, resource match, related match, subject, body). Bodies are Prefect's Jinja templates.
NOTICES: dict[str, tuple[list[str], dict, dict, str, str]] = {
    "approval waiting": (
        ["cifar.approval.waiting"], {"prefect.resource.id": "cifar.model.*"}, {},
        "cifar: {{ event.payload.model }} v{{ event.payload.version }} waits for your approval",
        "{{ event.payload.model }} v{{ event.payload.version }} passed the gate against champion "
        "{{ 'v' ~ event.payload.champion_version if event.payload.champion_version else 'none' }}: "
        "{{ event.payload.reason }}. Approve or reject by "
        "{{ event.payload.expires_at }}: {{ event.payload.url }}",
    ),
    "champion moved": (
        ["cifar.champion.moved"], {"prefect.resource.id": "cifar.model.*"}, {},
        "cifar: {{ event.payload.model }} champion is now v{{ event.payload.to_version }}",
        "{{ event.payload.model }} champion "
        "{{ 'v' ~ event.payload.from_version if event.payload.from_version else 'none' }} -> "
        "v{{ event.payload.to_version }} "
        "({{ event.payload.how }}, by {{ event.payload.by }}): {{ event.payload.reason }}",
    ),
    "run failed": (
        ["prefect.flow-run.Failed", "prefect.flow-run.Crashed"], {"prefect.resource.id": "prefect.flow-run.*"},
        {"prefect.resource.role": "deployment"},
        "cifar: {{ flow.name }}/{{ deployment.name }} run {{ flow_run.name }} ended {{ flow_run.state.name }}",
        "Flow run {{ flow_run.name }} of {{ flow.name }}/{{ deployment.name }} ended {{ flow_run.state.name }}: "
        "{{ flow_run.state.message }} (flow run {{ flow_run.id }}{{ ', ' ~ (flow_run|ui_url) if flow_run|ui_url }})",
    ),
    "drift detected": (
        ["cifar.drift.detected"], {"prefect.resource.id": "cifar.model.*"}, {},
        "cifar: drift in the images scored by {{ event.payload.model }} v{{ event.payload.version }}",
        "{{ event.payload.images }} images of {{ event.payload.input }}: {{ event.payload.reasons | join('; ') }}. "
        "Predictions: {{ event.payload.predictions }}",
    ),
    "endpoint refused a version": (
        ["cifar.serving.version.refused"], {"prefect.resource.id": "cifar.model.*"}, {},
        "cifar: the endpoint refused {{ event.payload.model }} v{{ event.payload.version }}",
        "The served endpoint keeps its running version; {{ event.payload.model }} v{{ event.payload.version }} "
        "was refused: {{ event.payload.reason }}",
    ),
}  # fmt: skip


ZOMBIE_AUTOMATION = "cifar: crash flow runs whose heartbeats stopped"
# Completed states named by our flows: the search's pruned trial, a retrain with nothing to do, a sign-off.
OWN_FINAL_STATES = ("Pruned", "Nothing changed", "Approved", "Rejected")
ENDS_A_WATCH = ("Completed", "Failed", "Cancelled", "Crashed", "Suspended", *OWN_FINAL_STATES)


def zombie_automation(crashed_after: int):
    from prefect.automations import AutomationCore
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    trigger = EventTrigger(
        posture=Posture.Proactive,
        after={"prefect.flow-run.heartbeat"},
        expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{state}" for state in ENDS_A_WATCH)},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        for_each={"prefect.resource.id"},
        threshold=1,
        within=crashed_after,
    )
    message = f"No heartbeat for {crashed_after} s: the flow run's process is gone (container killed or lost)."
    action = ChangeFlowRunState(state="CRASHED", message=message)
    description = f"Marks a flow run CRASHED when its heartbeats stop for {crashed_after} s before a final state."
    return AutomationCore(
        name=ZOMBIE_AUTOMATION, description=description, enabled=True, trigger=trigger, actions=[action]
    )


def webhook_url() -> str | None:
    """The webhook URL from the environment, or from the file CIFAR_NOTIFY_WEBHOOK_URL_FILE names."""
    if url := os.environ.get(URL_ENV, "").strip():
        return url
    if path := os.environ.get(URL_FILE_ENV, "").strip():
        try:
            return Path(path).read_text(encoding="utf-8").strip() or None
        except OSError as error:
            raise ValueError(f"{URL_FILE_ENV}={path} cannot be read: {error.strerror}") from None
    return None


def notification_block_id(url: str | None):
    """The id of the block the automations send through: ours (made or updated from `url`), else yours."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client

    if url:
        block = CustomWebhookNotificationBlock(
            name="cifar",
            url="{{ webhook_url }}",  # Filled from the secrets when sending: the URL stays a secret.
            json_data={"text": "*{{ subject }}*\n{{ body }}"},
            secrets={"webhook_url": url},
        )
        return block.save(BLOCK_NAME, overwrite=True)
    with get_client(sync_client=True) as client:  # Any kind of block, so not Block.load (one kind).
        found = [block for block in client.read_block_documents(include_secrets=False) if block.name == BLOCK_NAME]
    return found[0].id if found else None


def automations(block_id) -> list:
    from prefect.automations import AutomationCore, SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture

    made = []
    for name, (expect, match, related, subject, body) in NOTICES.items():
        trigger = EventTrigger(
            expect=set(expect),
            match=match,
            match_related=related,
            for_each={"prefect.resource.id"},
            posture=Posture.Reactive,
            threshold=1,
            within=0,
        )
        action = SendNotification(block_document_id=block_id, subject=subject, body=body)
        made.append(AutomationCore(name=PREFIX + name, description=f"Notifies {BLOCK_NAME}: {name}.",
                                   enabled=True, trigger=trigger, actions=[action]))  # fmt: skip
    return made


def comparable(value):
    """An automation's definition as JSON values without ids, sets and lists in one order: what to compare."""
    if isinstance(value, dict):
        return {key: comparable(item) for key, item in value.items() if key != "id"}
    if isinstance(value, list):
        return sorted((comparable(item) for item in value), key=repr)
    return value


def ensure(automation) -> bool:
    """Creates `automation`, or updates the one of its name when its definition differs (and removes any
    duplicate); whether anything changed. An unchanged automation is left alone: an update resets its
    trigger's state, and the crash rule would forget the runs it watches (a restarted worker's killed run)."""
    from prefect.client.orchestration import get_client

    wanted = comparable(automation.model_dump(mode="json"))
    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(automation.name)
        for duplicate in existing[1:]:  # Two workers starting at once may both have created it.
            client.delete_automation(duplicate.id)
        if not existing:
            client.create_automation(automation)
            return True
        current = comparable(existing[0].model_dump(mode="json", include=set(type(automation).model_fields)))
        if current == wanted:
            return False
        client.update_automation(existing[0].id, automation)
        return True


def ensure_notifications() -> str:
    """Creates or updates the block and the notification automations; returns a line saying what it did."""
    block_id = notification_block_id(webhook_url())
    if block_id is None:
        return (
            f"notifications: none (set {URL_ENV} or {URL_FILE_ENV}, or make a notification block named "
            f"{BLOCK_NAME}, then run this again)"
        )
    for automation in automations(block_id):
        ensure(automation)
    return f"notifications: {len(NOTICES)} automations send through the block {BLOCK_NAME}"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="flows/automations.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--crashed-after", type=int, metavar="SECONDS", help="also the crash rule, this window")
    args = parser.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        print("error: automations live on a Prefect server: set PREFECT_API_URL", file=sys.stderr)
        return 2
    if args.crashed_after is not None and args.crashed_after < 10:
        print("error: --crashed-after must be at least 10 s (twice the heartbeat at least)", file=sys.stderr)
        return 2
    try:
        if args.crashed_after is not None:
            changed = ensure(zombie_automation(args.crashed_after))
            print(f"automations: {ZOMBIE_AUTOMATION} ({args.crashed_after} s, {'made' if changed else 'as it was'})")
        print(ensure_notifications())
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
