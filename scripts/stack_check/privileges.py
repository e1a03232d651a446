"""Every process of the stack runs unprivileged, and only the front door publishes ports, on 127.0.0.1 only."""

from __future__ import annotations

import json

from scripts.stack_check.context import Context
from scripts.stack_check.report import Row
from scripts.stack_check.shell import StepError

# Users the images run as: uid 1000, the postgres image's 999, and Debian's caddy user in the proxy.
UNPRIVILEGED = {"cifar", "postgres", "caddy"}


def check_privileges(context: Context, row: Row) -> None:
    stack = context.stack
    processes, users = 0, set()
    for container in stack.containers(all=False):
        if stack.engine.name == "podman":  # The user inside the container, by name.
            result = stack.engine("top", container, "user", "pid", "args", timeout=60)
        else:  # `docker top` runs ps on the host: numeric uids (the host may name them otherwise).
            result = stack.engine("top", container, "-eo", "uid,pid,args", timeout=60)
        for line in result.stdout.splitlines()[1:]:
            words = line.split()
            if not words:
                continue
            processes += 1
            users.add(words[0])
            if words[0] not in UNPRIVILEGED and not (words[0].isdigit() and words[0] != "0"):
                raise StepError(f"{container} runs {' '.join(words[2:])[:80]} as {words[0]}")
    published = 0
    proxies = stack.containers("proxy", all=False)
    for container in stack.containers(all=False):
        ports = stack.engine("inspect", "--format", "{{json .HostConfig.PortBindings}}", container, timeout=60)
        for bindings in (json.loads(ports.stdout) or {}).values():
            for binding in bindings or []:
                published += 1
                if binding.get("HostIp") != "127.0.0.1":
                    raise StepError(f"{container} publishes {binding} beyond 127.0.0.1")
                if container not in proxies:
                    raise StepError(f"{container} publishes {binding}: only the proxy may")
    containers = len(stack.containers(all=False))
    row.detail = (
        f"{processes} processes in {containers} containers, as {', '.join(sorted(users))}, none as root; "
        f"{published} published ports, all the proxy's, all on 127.0.0.1"
    )
