"""What a worker needs on the Prefect server before it starts, made once per start in one process.

    python flows/worker_setup.py --pool cifar-process --crashed-after 90    # docker/entrypoint.sh

1. the process work pool, when missing;
2. the `training` concurrency limit (1: one training per device), when missing;
3. the crash rule and the notifications (flows/automations.py), made or updated to this code's definition;
4. every deployment of prefect.yaml (`prefect --no-prompt deploy --all`), unless the server already has
   them from this very code: prefect.yaml and every Python file of cifar/, tasks/ and flows/ give a digest,
   kept in the Prefect variable `cifar_deployed_code` after a deploy. A worker restarted (killed, stopped,
   the stack down and up, a second worker added) then starts ~7 s sooner and leaves the deployments, and
   a schedule someone paused, as they are; a new image, or a deployment deleted by hand, deploys again.

Each step tolerates another worker doing the same at the same moment (both then deploy; that is harmless).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import yaml

APP_DIR = Path(__file__).resolve().parents[1]  # The image's /app, or a checkout.
sys.path.insert(0, str(APP_DIR))  # This checkout first, installed or not.
CODE_DIRECTORIES = ("cifar", "tasks", "flows")
DEPLOYED_VARIABLE = "cifar_deployed_code"
TRAINING_TAG = "training"  # tasks/training.py's tag: its limit is how many trainings run at once.


def code_digest(root: Path = APP_DIR, pool: str = "") -> str:
    """SHA-256 of prefect.yaml, every Python file of the code directories (by relative path), the pool and
    the Prefect version: what a deployment's definition and its parameters' form are made from."""
    import prefect

    digest = hashlib.sha256(f"prefect {prefect.__version__} | pool {pool}\n".encode())
    files = [root / "prefect.yaml"]
    files += sorted(path for name in CODE_DIRECTORIES for path in (root / name).rglob("*.py"))
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def declared_deployments(root: Path = APP_DIR) -> set[str]:
    return {entry["name"] for entry in yaml.safe_load((root / "prefect.yaml").read_text())["deployments"]}


def ensure_pool_and_limit(pool: str, training_slots: int = 1) -> list[str]:
    """The process work pool and the `training` limit (`training_slots` trainings at once), each made when
    missing; what was made."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    made = []
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            template = ProcessWorker.get_default_base_job_template()
            try:  # Another worker may make it at the same moment.
                client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
                made.append(f"work pool {pool}")
            except ObjectAlreadyExists:
                pass
        try:
            client.read_concurrency_limit_by_tag(TRAINING_TAG)
        except ObjectNotFound:
            client.create_concurrency_limit(tag=TRAINING_TAG, concurrency_limit=training_slots)
            made.append(f"concurrency limit {TRAINING_TAG}={training_slots}")
    return made


def deployments_current(digest: str, names: set[str]) -> bool:
    """Whether the server's deployments were made from this code and all of them are still there."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.variables import Variable

    if Variable.get(DEPLOYED_VARIABLE, default=None) != digest:
        return False
    with get_client(sync_client=True) as client:
        found = client.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=list(names))))
    return names <= {deployment.name for deployment in found}


def deploy(digest: str) -> None:
    subprocess.run(["prefect", "--no-prompt", "deploy", "--all"], cwd=APP_DIR, check=True)
    from prefect.variables import Variable

    Variable.set(DEPLOYED_VARIABLE, digest, overwrite=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flows/worker_setup.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", default="cifar-process", help="the work pool the worker serves")
    parser.add_argument("--crashed-after", type=int, metavar="SECONDS", required=True, help="the crash rule's window")
    args = parser.parse_args(argv)
    from flows import automations

    made = ensure_pool_and_limit(args.pool)
    print(f"worker setup: made {', '.join(made)}" if made else "worker setup: pool and training limit present")
    status = automations.main(["--crashed-after", str(args.crashed_after)])
    if status:
        return status
    digest = code_digest(pool=args.pool)
    if deployments_current(digest, declared_deployments()):
        print(f"deployments: as deployed from this code before ({digest[:12]}), not deployed again")
    else:
        deploy(digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
