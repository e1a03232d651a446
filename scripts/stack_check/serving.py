"""The champion served by the runtime image (compose profile `serve`: the endpoint, flows/serve.py) answers test
images as the SavedModel does, through the front door."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from scripts.stack_check.context import Context
from scripts.stack_check.pipeline import MODEL_NAME
from scripts.stack_check.report import Answer, Row
from scripts.stack_check.shell import StepError

# Run in a worker container: the exported SavedModel's serving signature on the images given on stdin.
SAVED_MODEL_PREDICT = """
import json, sys
import numpy as np, tensorflow as tf
from cifar.export import INPUT_NAME, SERVING_SIGNATURE
request = json.load(sys.stdin)
serve = tf.saved_model.load(request["export_dir"]).signatures[SERVING_SIGNATURE]
outputs = serve(**{INPUT_NAME: tf.constant(np.array(request["images"], dtype=np.uint8))})
print(json.dumps({"class_ids": outputs["class_ids"].numpy().tolist(),
                  "probabilities": outputs["probabilities"].numpy().tolist()}))
"""


def first_test_images(archive: Path, count: int) -> tuple[np.ndarray, list[int], list[str]]:
    """The first `count` images of the archive's test batch (uint8 [N, 32, 32, 3]), their labels, class names.

    Read as the pipeline reads archives: the restricted unpickler, shapes and labels checked.
    """
    from cifar.data.archive import read_archive

    raw = read_archive(archive)
    labels = [int(label) for label in raw.test_labels[:count]]
    return np.ascontiguousarray(raw.test_images[:count]), labels, list(raw.class_names)


def check_serving(context: Context, row: Row) -> None:
    stack = context.stack
    started = time.monotonic()
    stack.compose("up", "-d", "serve", profiles=("serve",))
    images, labels, names = first_test_images(context.settings.archive, 100)
    export_dir = context.findings.smoke_summary.export.export_dir
    request = json.dumps({"export_dir": export_dir, "images": images.tolist()})
    reloaded = json.loads(stack.exec("worker", "python", "-c", SAVED_MODEL_PREDICT, input=request, timeout=300).stdout)
    correct = [index for index in range(len(labels)) if reloaded["class_ids"][index] == labels[index]]
    if len(correct) < 3:
        raise StepError(f"the SavedModel gets only {len(correct)} of the first 100 test images right")
    chosen = correct[:3]
    stack.wait_healthy(["serve"], 420)
    ready_seconds = wait_ready(stack, 120)
    body = {"inputs": images[chosen].tolist()}
    served = stack.http("POST", f"{stack.serve_url}/invocations", body, auth=stack.credentials("serve"))
    predictions = served["predictions"]
    if served.get("version") != context.findings.smoke_summary.promotion.registered_model_version:
        raise StepError(f"the endpoint answered with version {served.get('version')}, not the champion")
    for position, index in enumerate(chosen):
        served_id = int(predictions["class_ids"][position])
        context.report.answers.append(
            Answer(
                index=index,
                label=names[labels[index]],
                served=str(predictions["class_names"][position]),
                saved_model=names[reloaded["class_ids"][index]],
                served_p=float(predictions["probabilities"][position][served_id]),
                saved_model_p=float(reloaded["probabilities"][index][served_id]),
            )
        )
        if (
            served_id != reloaded["class_ids"][index]
            or served_id != labels[index]
            or predictions["class_names"][position] != names[served_id]
        ):
            raise StepError(f"test image #{index}: served {served_id}, SavedModel {reloaded['class_ids'][index]}")
        gap = max(abs(a - b) for a, b in zip(predictions["probabilities"][position], reloaded["probabilities"][index]))
        if gap > 1e-4:
            raise StepError(f"test image #{index}: probabilities differ by {gap}")
    row.detail = (
        f"the endpoint (flows/serve.py) following models:/{MODEL_NAME}@champion in the runtime image (compose "
        f"profile serve), ready {ready_seconds:.0f} s after healthy, through the front door, version "
        f"{served['version']}, "
        f"test images #{', #'.join(map(str, chosen))}: served = SavedModel {export_dir.rsplit('/', 1)[-1]} "
        f"= label ({time.monotonic() - started:.0f} s)"
    )


def wait_ready(stack, timeout: float) -> float:
    """Seconds until the endpoint serves a verified version (/health/ready through the front door)."""
    started = time.monotonic()
    while True:
        response = stack.client.get(f"{stack.serve_url}/health/ready", auth=stack.credentials("serve"))
        if response.status_code == 200:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise StepError(f"the endpoint is not ready after {timeout:.0f} s: {response.text[:300]}")
        time.sleep(1)
