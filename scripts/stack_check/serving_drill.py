"""The endpoint follows the champion under load, through the front door with credentials.

Eight clients send a test photo one request after another while the alias moves (until 3 s after the last switch,
about 25 s; the load has no other purpose than being there when it moves): to a new
version (a promotion), to a version whose files are damaged (refused, the running version keeps serving), then
back (a rollback). Zero failed answers, every answer names its version, each client sees the versions in the
order the alias took them, each switch within 60 s. Then an overload (more clients at once than the stack's
drill queue holds, DRILL_SERVE_SETTINGS): 503s with Retry-After and no other 5xx. A request without credentials: 401.
"""

from __future__ import annotations

import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import numpy as np

from scripts.stack_check.context import Context
from scripts.stack_check.pipeline import MODEL_NAME
from scripts.stack_check.report import Row
from scripts.stack_check.serving import first_test_images, wait_ready
from scripts.stack_check.shell import StepError

CLIENTS, OVERLOAD_CLIENTS, SETTLE_SECONDS, SWITCH_SECONDS = 8, 64, 3, 60
OVERLOAD_PHOTOS = 16  # Per request of the overload: one such request fills the drill's queue (DRILL_SERVE_SETTINGS).

# Run in a worker container (its MLflow identity may register): a second version with the champion's files (to
# promote) and a third whose variables are truncated, logged beside the champion's run.
PREPARE_VERSIONS = """
import json, pathlib, tempfile
import mlflow
client, name = mlflow.MlflowClient(), "%s"
champion = client.get_model_version_by_alias(name, "champion")
model_id = champion.source.removeprefix("models:/") if champion.source.startswith("models:/m-") else None
copy = client.create_model_version(name, champion.source, run_id=champion.run_id, model_id=model_id,
                                   description="stack check: the champion's files again, promoted by the drill")
local = pathlib.Path(mlflow.artifacts.download_artifacts(
    artifact_uri=client.get_model_version_download_uri(name, champion.version), dst_path=tempfile.mkdtemp()))
(variables,) = local.rglob("variables.data-*")
variables.write_bytes(variables.read_bytes()[:100])
experiment = client.get_run(champion.run_id).info.experiment_id
with mlflow.start_run(experiment_id=experiment, run_name="stack check: a damaged copy") as run:
    mlflow.log_artifacts(str(local), artifact_path="model")
damaged = client.create_model_version(name, run.info.artifact_uri + "/model", run_id=run.info.run_id,
                                      description="stack check: damaged files, must be refused by the endpoint")
print(json.dumps({"champion": int(champion.version), "copy": int(copy.version), "damaged": int(damaged.version)}))
"""


@dataclass
class Client:
    versions: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def png_of(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def check_serving_follows(context: Context, row: Row) -> None:
    stack = context.stack
    versions = json.loads(
        stack.exec("worker", "python", "-c", PREPARE_VERSIONS % MODEL_NAME, timeout=300).stdout.strip().splitlines()[-1]
    )
    wait_ready(stack, 120)
    photo = png_of(first_test_images(context.settings.archive, 1)[0][0])
    url, auth, verify = f"{stack.serve_url}/predict", stack.credentials("serve"), str(stack.ca_file)
    clients, stop = [Client() for _ in range(CLIENTS)], threading.Event()

    def hammer(client: Client) -> None:
        with httpx.Client(verify=verify, auth=auth, timeout=60) as session:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    reply = session.post(url, content=photo, headers={"Content-Type": "image/png"})
                except httpx.HTTPError as error:
                    client.failures.append(f"{type(error).__name__}: {error}")
                    continue
                if reply.status_code != 200:
                    client.failures.append(f"HTTP {reply.status_code}: {reply.text[:200]}")
                    continue
                version = reply.json()["version"]
                if reply.headers.get("X-Model-Version") != str(version):
                    client.failures.append(f"header {reply.headers.get('X-Model-Version')} != body {version}")
                client.versions.append(version)
                client.latencies.append(time.monotonic() - started)

    def move_alias(version: int) -> None:
        stack.http("POST", f"{stack.mlflow_url}/api/2.0/mlflow/registered-models/alias",
                   {"name": MODEL_NAME, "alias": "champion", "version": str(version)},
                   auth=stack.credentials("mlflow-worker"))  # fmt: skip

    def status() -> dict:
        return stack.http("GET", f"{stack.serve_url}/version", auth=auth)

    def wait_for(condition, what: str) -> float:
        started = time.monotonic()
        while not condition(status()):
            if time.monotonic() - started > SWITCH_SECONDS:
                raise StepError(f"{what}: not within {SWITCH_SECONDS} s; the endpoint says {status()}")
            time.sleep(0.5)
        return time.monotonic() - started

    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        running = [pool.submit(hammer, client) for client in clients]
        try:
            time.sleep(SETTLE_SECONDS)
            move_alias(versions["copy"])  # A promotion.
            promoted = wait_for(lambda s: (s["serving"] or {}).get("version") == versions["copy"], "the promotion")
            time.sleep(SETTLE_SECONDS)
            move_alias(versions["damaged"])  # Damaged files: refused, the promoted version keeps serving.
            refused = wait_for(lambda s: any(r["version"] == versions["damaged"] for r in s["refused"]), "the refusal")
            reason = next(r["reason"] for r in status()["refused"] if r["version"] == versions["damaged"])
            time.sleep(SETTLE_SECONDS)
            move_alias(versions["champion"])  # The rollback.
            rolled = wait_for(lambda s: (s["serving"] or {}).get("version") == versions["champion"], "the rollback")
            time.sleep(SETTLE_SECONDS)  # Answers from the rolled-back version under load, then the load stops.
        finally:
            stop.set()
            for future in running:
                future.result()
    load_seconds = time.monotonic() - started

    failures = [failure for client in clients for failure in client.failures]
    if failures:
        raise StepError(f"{len(failures)} failed answers under load, e.g. {failures[:3]}")
    timeline = [versions["champion"], versions["copy"], versions["champion"]]
    for index, client in enumerate(clients):
        seen = [v for position, v in enumerate(client.versions) if position == 0 or client.versions[position - 1] != v]
        if versions["damaged"] in seen or not any(seen == timeline[start : start + len(seen)] for start in range(3)):
            raise StepError(f"client {index} saw versions {seen}, not in the alias's order {timeline}")
    latencies = sorted(latency for client in clients for latency in client.latencies)
    answers = len(latencies)

    overload = burst(url, photo, auth, verify)
    codes = sorted(overload)
    if overload.get(503, 0) == 0 or any(code >= 500 and code != 503 for code in codes):
        raise StepError(f"an overload of {OVERLOAD_CLIENTS} clients got {overload}: expected 503s and no other 5xx")
    anonymous = httpx.post(url, content=photo, headers={"Content-Type": "image/png"}, verify=verify, timeout=30)
    if anonymous.status_code != 401:
        raise StepError(f"a request without credentials got HTTP {anonymous.status_code}, not 401")
    row.detail = (
        f"{CLIENTS} clients x {load_seconds:.0f} s through the front door: {answers:,} answers, 0 failed, p50 "
        f"{1000 * latencies[answers // 2]:.0f} ms, p99 {1000 * latencies[int(answers * 0.99)]:.0f} ms; promotion "
        f"v{versions['champion']}->v{versions['copy']} served after {promoted:.1f} s, damaged v{versions['damaged']} "
        f"refused after {refused:.1f} s ({reason[:80]}), rollback served after {rolled:.1f} s; each client saw "
        f"the alias's order; overload of {OVERLOAD_CLIENTS}: {dict(overload)} (503s with Retry-After); no "
        "credentials: 401"
    )


def burst(url: str, photo: bytes, auth: tuple[str, str], verify: str) -> dict[int, int]:
    """Status counts of OVERLOAD_CLIENTS clients each sending 3 requests of OVERLOAD_PHOTOS photos at once (a
    second request arriving while one waits overflows the drill's queue); every 503 must say Retry-After."""
    counts: dict[int, int] = {}
    lock = threading.Lock()
    files = [("photos", (f"{index}.png", photo, "image/png")) for index in range(OVERLOAD_PHOTOS)]

    def send(_: int) -> None:
        with httpx.Client(verify=verify, auth=auth, timeout=60) as session:
            for _ in range(3):
                reply = session.post(url, files=files)
                if reply.status_code == 503 and "Retry-After" not in reply.headers:
                    raise StepError("a 503 without Retry-After")
                with lock:
                    counts[reply.status_code] = counts.get(reply.status_code, 0) + 1

    with ThreadPoolExecutor(OVERLOAD_CLIENTS) as pool:
        list(pool.map(send, range(OVERLOAD_CLIENTS)))
    return counts
