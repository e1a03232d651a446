"""The stack check's steps, in order: one list of named functions, whose names are the report's rows."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from harness.compose import generate_secrets, write_env_file
from harness.ports import free_port
from scripts.stack_check.access import check_bare_ports, check_identities, check_no_secrets, check_sign_in
from scripts.stack_check.approval_drill import check_approval
from scripts.stack_check.cluster_drills import check_lost_worker, check_lost_worker_resume
from scripts.stack_check.context import DRILL_SERVE_SETTINGS, DRILL_TIMINGS, Context
from scripts.stack_check.drills import check_kill, check_resume_after_stop, check_resume_then_stop, check_search
from scripts.stack_check.engine import Engine, install_tools
from scripts.stack_check.images import build_images, choose_bases
from scripts.stack_check.outages import check_outages
from scripts.stack_check.pipeline import check_mlflow, check_prefect_database, check_restart, check_smoke_run
from scripts.stack_check.privileges import check_privileges
from scripts.stack_check.remote import REMOTE_NAME, check_remote_worker
from scripts.stack_check.report import Row
from scripts.stack_check.restore_drill import check_restore
from scripts.stack_check.serving import check_serving
from scripts.stack_check.serving_drill import check_serving_follows
from scripts.stack_check.stack import Stack
from scripts.stack_check.teardown import teardown


@dataclass(frozen=True)
class Step:
    name: str  # Its row in the report.
    run: Callable[[Context, Row], None]


def check_tools(context: Context, row: Row) -> None:
    context.engine = Engine(context.shell, context.settings.engine)
    install_tools(context.engine, row, need_mmdebstrap=context.settings.bases != "official")


def check_bases(context: Context, row: Row) -> None:
    context.bases = choose_bases(context.engine, context.settings.bases, context.report, row)


def check_images(context: Context, row: Row) -> None:
    """The compose project's variables (generated passwords, free 127.0.0.1 ports, the archive's directory as
    the workers' read-only /data, the base images), then every image built with them."""
    generated = generate_secrets({})
    for secret in generated.values():
        context.shell.hide(secret)
    context.variables = {
        **generated,
        # The name the other machine's worker (scripts/stack_check/remote.py) knows the front door by.
        "CIFAR_PROXY_NAMES": REMOTE_NAME,
        "PREFECT_HOST_PORT": str(free_port()),
        "MLFLOW_HOST_PORT": str(free_port()),
        "SERVE_HOST_PORT": str(free_port()),
        "CIFAR_DATA_DIR": str(context.settings.archive.resolve().parent),
        # Two checks at once on one machine (two branches) build and run their own images.
        "CIFAR_IMAGE_TAG": os.environ.get("CIFAR_IMAGE_TAG", "latest"),
        **DRILL_TIMINGS,
        **DRILL_SERVE_SETTINGS,
        **context.bases,
    }
    build_images(context.engine, context.variables, context.settings.gpu, context.report, row)


def check_stack_up(context: Context, row: Row) -> None:
    settings, variables = context.settings, context.variables
    env_file = settings.scratch / "stack.env"
    write_env_file(env_file, variables)
    context.stack = Stack(context.engine, settings.project, env_file, variables)
    seconds = context.stack.up()
    context.stack.pause_nightly()
    row.detail = (
        f"project {settings.project}: postgres, prefect-server, mlflow, proxy, worker healthy in {seconds:.0f} s "
        f"(front door: Prefect https://127.0.0.1:{variables['PREFECT_HOST_PORT']}, "
        f"MLflow https://127.0.0.1:{variables['MLFLOW_HOST_PORT']}, the local CA's certificate verified)"
    )


CHECKS = (
    Step("tools", check_tools),
    Step("base images", check_bases),
    Step("images built", check_images),
    Step("stack up, every service healthy", check_stack_up),
    Step("no or wrong credentials: 401 on every door", check_sign_in),
    Step("bare curl: TLS error; plain HTTP refused", check_bare_ports),
    Step("cifar/smoke on the archive, through the worker", check_smoke_run),
    Step("flow run in Prefect's PostgreSQL", check_prefect_database),
    Step("MLflow run, metrics, champion, artifacts", check_mlflow),
    Step("stack stopped and started: all still there", check_restart),
    Step("served champion = reloaded SavedModel", check_serving),
    Step("endpoint follows the alias under load; overload; 401", check_serving_follows),
    Step("new data, retrain waits; approved, served; rejected", check_approval),
    Step("backup, every volume deleted, restore: all back", check_restore),
    Step("PostgreSQL, Prefect, MLflow restarted mid-training", check_outages),
    Step("worker killed mid-training: CRASHED", check_kill),
    Step("re-run resumes; its worker stopped (SIGTERM): saved", check_resume_then_stop),
    Step("re-run after the stop resumes from that step", check_resume_after_stop),
    Step("2 workers: 4-trial search, parallel 2", check_search),
    Step("2-worker job: a worker container killed", check_lost_worker),
    Step("2-worker job run again: resumes on both", check_lost_worker_resume),
    Step("MLflow identities: viewer 403, worker allowed", check_identities),
    Step("worker on another network: smoke via the front door", check_remote_worker),
    Step("no secret in images, logs, MLflow or Prefect", check_no_secrets),
    Step("unprivileged; only the proxy publishes, 127.0.0.1", check_privileges),
)
TEARDOWN = Step("teardown: nothing left behind", teardown)  # Last, whatever happened before.
