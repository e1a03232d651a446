"""Everything the run made removed (containers, volumes, networks, pods), also after a failure; images stay."""

from __future__ import annotations

import contextlib

from scripts.stack_check.context import Context
from scripts.stack_check.engine import Engine
from scripts.stack_check.remote import remove_remote_worker
from scripts.stack_check.report import Row
from scripts.stack_check.shell import StepError
from scripts.stack_check.stack import Stack


def leftovers(engine: Engine, project: str) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={project}"
    found = {
        "containers": engine("ps", "-a", "--format", "{{.Names}}", "--filter", label, timeout=60).stdout.split(),
        "volumes": engine("volume", "ls", "--format", "{{.Name}}", "--filter", label, timeout=60).stdout.split(),
        "networks": [
            name
            for name in engine("network", "ls", "--format", "{{.Name}}", timeout=60).stdout.split()
            if name.startswith(project)
        ],
    }
    if engine.name == "podman":
        pods = engine("pod", "ls", "--format", "{{.Name}}", timeout=60).stdout.split()
        found["pods"] = [name for name in pods if project in name]
    return {kind: names for kind, names in found.items() if names}


def remove_project(engine: Engine, stack: Stack | None, project: str) -> dict[str, list[str]]:
    """`down -v`, then whatever it missed (a failed start, a half-made container) one by one; what that was."""
    if stack is not None:
        with contextlib.suppress(StepError):
            remove_remote_worker(stack)  # Its own compose project (scripts/stack_check/remote.py).
        with contextlib.suppress(StepError):
            # podman-compose 1.6's `down` knows only the first container of a scaled service: the others
            # (worker 2) would keep the services they depend on, and their volumes, from being removed.
            for container in stack.containers() if engine.name == "podman" else []:
                if not container.endswith("_1"):
                    engine("rm", "-f", container, timeout=120)
            stack.down(volumes=True)
    left = leftovers(engine, project)
    removals = {"containers": ("rm", "-f", "-v"), "pods": ("pod", "rm", "-f"), "volumes": ("volume", "rm", "-f"),
                "networks": ("network", "rm", "-f")}  # fmt: skip
    for kind, command in removals.items():
        for name in left.get(kind, []):
            engine(*command, name, check=False, timeout=120)
    return left


def teardown(context: Context, row: Row) -> None:
    """Everything removed; nothing may be left. The images are the next run's build cache."""
    engine, project = context.engine, context.settings.project
    left = remove_project(engine, context.stack, project)
    remaining = {**leftovers(engine, f"{project}-remote"), **leftovers(engine, project)}
    if remaining:
        raise StepError(f"still there: {remaining}")
    row.detail = f"no container, volume, network or pod of {project} left" + (
        f" (removed after `down`: {left})" if left else ""
    )
