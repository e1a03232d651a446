"""The release loop with a person's sign-off, through the stack: new data, a retrain that waits, approval, the
endpoint follows; a second challenger rejected; the viewer's approval refused; the team notified once each.

A webhook receiver runs beside the worker (in its container, so the Prefect server reaches it on the compose
network) and keeps every message; `flows/automations.py` points the notifications at it. The nightly
deployment's trigger on new data is switched off for the drill (its config is the `full` preset: hours of
training); the retrain is started by hand with the smoke config, approval required, and a gate any
challenger passes.
"""

from __future__ import annotations

import json
import time

from scripts.stack_check.context import SHORT_EPOCHS, TOLERANT_GATE, Context
from scripts.stack_check.pipeline import MODEL_NAME
from scripts.stack_check.report import Row
from scripts.stack_check.shell import StepError, wait_until
from scripts.stack_check.stack import WORKDIR, Stack

RECEIVER_PORT, RECEIVED = 8099, "/tmp/cifar-notifications.jsonl"
# It listens on the container's own address on the compose network (where the Prefect server reaches it by the
# container's name), not on every interface.
RECEIVER = f"""
import http.server, socket
class Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with open("{RECEIVED}", "ab") as received:
            received.write(body.replace(b"\\n", b" ") + b"\\n")
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer((socket.gethostbyname(socket.gethostname()), {RECEIVER_PORT}), Hook).serve_forever()
"""
NEW_PHOTOS = f"""
from pathlib import Path
from cifar.data.synthetic import make_split, write_image_folder
write_image_folder(Path("{WORKDIR}/approval-photos"), *make_split(40, seed=47))
"""
# The smoke recipe on the workdir's archive and latest snapshot, a sign-off required, and a gate any
# challenger passes, with short epochs (the point is the sign-off, not the smoke model's accuracy).
CONFIG = {"preset": "smoke", "train": SHORT_EPOCHS, "export": TOLERANT_GATE, "promotion": {"approval": "required"}}
WAITING, MOVED = "waits for your approval", "champion is now"
NEW_DATA_TRIGGER = "cifar-retrain-on-new-data"


def messages(stack: Stack) -> list[str]:
    result = stack.exec("worker", "cat", RECEIVED, check=False, timeout=60)
    return [json.loads(line).get("text", line) for line in result.stdout.splitlines() if line.strip()]


def wait_message(stack: Stack, fragment: str, count: int = 1, timeout: float = 120) -> list[str]:
    def probe():
        found = [text for text in messages(stack) if fragment in text]
        return found if len(found) >= count else None

    return wait_until(f"{count} notification(s) with {fragment!r}", probe, timeout, interval=2)


def set_trigger(stack: Stack, enabled: bool) -> None:
    for automation in stack.prefect("POST", "/automations/filter", {}):
        if automation["name"] == NEW_DATA_TRIGGER:
            stack.prefect("PATCH", f"/automations/{automation['id']}", {"enabled": enabled})


def champion(stack: Stack) -> int:
    found = stack.mlflow("registered-models/alias", name=MODEL_NAME, alias="champion")
    return int(found["model_version"]["version"])


def served_version(stack: Stack) -> int | None:
    return (stack.http("GET", f"{stack.serve_url}/version", auth=stack.credentials("serve"))["serving"] or {}).get(
        "version"
    )


def retrain(stack: Stack, force: bool) -> tuple[str, float]:
    """A retrain of the nightly deployment, waited for until it is suspended; (its id, seconds to get there)."""
    started = time.monotonic()
    flow_run_id = stack.deployment_run(
        "cifar-retrain/nightly", {"config": CONFIG, "workdir": "./workdir", "force": force}, watch=False
    )
    run = stack.wait_flow_run(flow_run_id, {"PAUSED"}, timeout=900)
    if run["state"]["name"] != "Suspended":
        raise StepError(f"the retrain waits as {run['state']['name']}, not Suspended (it would hold its worker)")
    return flow_run_id, time.monotonic() - started


def check_approval(context: Context, row: Row) -> None:
    stack = context.stack
    worker = stack.container("worker", running=True)
    stack.engine("exec", "-d", worker, "python", "-c", RECEIVER, timeout=60)
    notify = f"CIFAR_NOTIFY_WEBHOOK_URL=http://{worker}:{RECEIVER_PORT}/hook"
    made = stack.exec("worker", "env", notify, "python", "flows/automations.py", timeout=120).stdout
    if "5 automations" not in made:
        raise StepError(f"flows/automations.py: {made[-300:]}")
    set_trigger(stack, False)
    try:
        detail = sign_off(context, stack)
    finally:
        set_trigger(stack, True)
    row.detail = detail


def sign_off(context: Context, stack: Stack) -> str:
    before = champion(stack)
    stack.exec("worker", "python", "-c", NEW_PHOTOS, timeout=120)
    added = stack.exec("worker", "python", "flows/ingest.py", "--add", f"{WORKDIR}/approval-photos",
                       "--workdir", "./workdir", timeout=600).stdout  # fmt: skip
    if "added 40 images" not in added:
        raise StepError(f"ingest: {added[-300:]}")

    # The retrain on the new data waits, suspended: its worker takes other work meanwhile.
    first, to_wait = retrain(stack, force=False)
    suspended_at = time.monotonic()
    other = stack.deployment_run(
        "cifar-approval-timeout/approval-timeout", {"flow_run_id": first, "workdir": "./workdir"}, watch=False
    )
    early = stack.wait_flow_run(other, {"COMPLETED"}, timeout=300)["state"]  # Its state says what it did.
    if early["name"] != "Not expired yet" or stack.flow_run(first)["state"]["type"] != "PAUSED":
        raise StepError(f"the timeout run, started 72 h early, did not leave the wait alone: {early}")
    wait_message(stack, WAITING)

    # The viewer may not decide; the maintainer approves through Prefect's API (what the form posts).
    viewer, password = stack.credentials("mlflow-viewer")
    refused = stack.exec("worker", "env", f"MLFLOW_TRACKING_USERNAME={viewer}", f"MLFLOW_TRACKING_PASSWORD={password}",
                         "python", "flows/promote.py", "--approve", first, "--reason", "the viewer tries",
                         "--workdir", "./workdir", check=False, timeout=300)  # fmt: skip
    if refused.returncode != 2 or "MLflow refused" not in refused.stderr:
        raise StepError(f"the viewer's approval was not refused: exit {refused.returncode}, {refused.stderr[-300:]}")
    answer = {"decision": "approve", "reason": "stack check: approved", "approver": "maintainer"}
    if stack.prefect("POST", f"/flow_runs/{first}/resume", {"run_input": answer})["status"] != "ACCEPT":
        raise StepError("the server did not accept the approval")
    waited, approved_at = time.monotonic() - suspended_at, time.monotonic()
    done = stack.wait_flow_run(first, {"COMPLETED"}, timeout=600)
    new = champion(stack)
    if done["state"]["name"] != "Approved" or new == before:
        raise StepError(f"after the approval: state {done['state']['name']}, champion v{before} -> v{new}")
    wait_until(f"the endpoint serving v{new}", lambda: served_version(stack) == new, 120, interval=1)
    followed = time.monotonic() - approved_at
    moved = wait_message(stack, MOVED)

    # A second challenger is rejected: the champion and the served version stay.
    second, _ = retrain(stack, force=True)
    wait_message(stack, WAITING, count=2)
    answer = {"decision": "reject", "reason": "stack check: rejected", "approver": "maintainer"}
    stack.prefect("POST", f"/flow_runs/{second}/resume", {"run_input": answer})
    done = stack.wait_flow_run(second, {"COMPLETED"}, timeout=600)
    if done["state"]["name"] != "Rejected" or champion(stack) != new or served_version(stack) != new:
        raise StepError(f"after the rejection: {done['state']['name']}, champion v{champion(stack)}")
    time.sleep(5)  # Room for a duplicate notification, were one sent.
    counts = [len([text for text in messages(stack) if fragment in text]) for fragment in (WAITING, MOVED)]
    if counts != [2, 1]:
        raise StepError(f"notifications {counts} (waiting, moved), not [2, 1]: {messages(stack)}")
    return (
        f"new data -> retrain suspended after {to_wait:.0f} s (worker free: the timeout run completed meanwhile, "
        "'not expired yet'); "
        f"viewer's --approve refused by MLflow; approved via the API after {waited:.0f} s of waiting: champion "
        f"v{before} -> v{new}, the endpoint served v{new} {followed:.1f} s after the approval; second challenger "
        f"rejected (champion and endpoint stay v{new}); notifications: 2 waiting, 1 moved "
        f"('{moved[0].splitlines()[-1][:70]}')"
    )
