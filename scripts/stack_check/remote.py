"""A worker "on another machine": docker/worker-remote.yaml on a network of its own that reaches only the proxy.

It knows the stack by the front door's name, the CA certificate and the workers' credentials, keeps its own
workdir, and runs `cifar/smoke` end to end into the shared registry; the local workers are stopped first so
the run can only be its. It must have no route to PostgreSQL, the Prefect server or the MLflow server.
"""

from __future__ import annotations

import json
import re
import time

from cifar.summary import PipelineSummary
from harness import REPO_ROOT
from harness.compose import DOCKER_DIR, write_env_file
from scripts.stack_check.context import DRILL_TIMINGS, SHORT_EPOCHS, TOLERANT_GATE, Context
from scripts.stack_check.pipeline import MODEL_NAME
from scripts.stack_check.report import Row
from scripts.stack_check.shell import StepError, last_line
from scripts.stack_check.stack import WORKDIR, Stack, archive_parameters

REMOTE_COMPOSE_FILE = DOCKER_DIR / "worker-remote.yaml"
REMOTE_NAME = "frontdoor"  # The proxy's name for the remote worker (on its certificate: CIFAR_PROXY_NAMES).
# Run in the remote worker: can it open a TCP connection to each of these (name or address, port)?
REACH = """
import json, socket, sys
result = {}
for host, port in json.load(sys.stdin):
    try:
        socket.create_connection((host, port), timeout=3).close()
        result[f"{host}:{port}"] = "open"
    except OSError as error:
        result[f"{host}:{port}"] = type(error).__name__
print(json.dumps(result))
"""


def remote_network(stack: Stack) -> str:
    return f"{stack.project}_remote"


def remote_compose(stack: Stack, env_file, override, *args: str, timeout: float = 900, check: bool = True):
    argv = [*stack.engine.compose_command(), "--env-file", env_file, "-p", stack.remote_project]
    argv += ["-f", REMOTE_COMPOSE_FILE, "-f", override, *args]
    return stack.engine.shell.run(argv, env=stack.engine.env, timeout=timeout, check=check, cwd=REPO_ROOT)


def start_remote_worker(context: Context) -> str:
    """An internal network with the proxy on it as `frontdoor`, the remote worker's project on it; its container."""
    stack, scratch = context.stack, context.settings.scratch
    network = remote_network(stack)
    stack.engine("network", "create", "--internal", network, timeout=60)
    proxy = stack.container("proxy")
    stack.engine("network", "connect", network, proxy, timeout=60)
    # Podman 4.3's DNS does not learn a name given at `network connect`: the worker gets it as a hosts entry.
    address = stack.engine(
        "inspect", "--format", f'{{{{(index .NetworkSettings.Networks "{network}").IPAddress}}}}', proxy, timeout=60
    ).stdout.strip()
    names = ("PREFECT_AUTH_STRING", "MLFLOW_WORKER_USERNAME", "MLFLOW_WORKER_PASSWORD", "CIFAR_DATA_DIR",
             "CIFAR_IMAGE_TAG", "CIFAR_PYTHON_IMAGE", *DRILL_TIMINGS)  # fmt: skip
    variables = {name: stack.variables[name] for name in names if name in stack.variables}
    variables.update(CIFAR_FRONT_DOOR=REMOTE_NAME, CIFAR_CA_BUNDLE=str(stack.ca_file))
    # On this network the worker meets the proxy container itself, on its own ports (another machine meets
    # the ports the stack's host publishes).
    variables.update(PREFECT_HOST_PORT="4200", MLFLOW_HOST_PORT="5000")
    env_file = scratch / "remote.env"
    write_env_file(env_file, variables)
    # The other machine's network: the remote project's default network is the internal one made above.
    override = scratch / "remote-network.yaml"
    override.write_text(
        f"services:\n  worker:\n    extra_hosts: ['{REMOTE_NAME}:{address}']\n"
        f"networks:\n  default:\n    name: {network}\n    external: true\n",
        encoding="utf-8",
    )
    remote_compose(stack, env_file, override, "up", "-d", "--no-build", "worker")
    [container] = stack.containers(project=stack.remote_project)
    stack.wait_healthy_containers([container], 600)
    return container


def unreachable(stack: Stack, container: str) -> dict[str, str]:
    """Whether the remote worker can open PostgreSQL, Prefect or MLflow, by name and by address."""
    targets = [["postgres", 5432], ["prefect-server", 4200], ["mlflow", 5000]]
    for service, port in list(targets):
        address = stack.engine(
            "inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
            stack.container(service), timeout=60,
        ).stdout.split()  # fmt: skip
        targets += [[ip, port] for ip in address]
    targets.append([REMOTE_NAME, 4200])
    result = stack.engine("exec", "-i", container, "python", "-c", REACH, input=json.dumps(targets), timeout=120)
    return json.loads(result.stdout)


def check_remote_worker(context: Context, row: Row) -> None:
    stack, started = context.stack, time.monotonic()
    for worker in stack.containers("worker", all=False):  # Every local one: the run can only be the remote one's.
        stack.engine("stop", worker, timeout=300)
    container = start_remote_worker(context)
    reach = unreachable(stack, container)
    opened = [target for target, answer in reach.items() if answer == "open" and not target.startswith(REMOTE_NAME)]
    if opened or reach.get(f"{REMOTE_NAME}:4200") != "open":
        raise StepError(f"the remote worker's connections: {reach}")
    # The point is that the gate's move reaches the shared registry through the front door: TOLERANT_GATE, SHORT_EPOCHS.
    archive = archive_parameters(context.settings.archive)
    config = {"preset": "smoke", "data": archive, "train": SHORT_EPOCHS, "export": TOLERANT_GATE}
    parameters = {"config": config}
    argv = ["prefect", "deployment", "run", "cifar/smoke", "--params", json.dumps(parameters), "--watch",
            "--watch-timeout", "1500"]  # fmt: skip
    result = stack.engine("exec", container, *argv, check=False, timeout=1620)
    found = re.search(r"UUID:\s*([0-9a-f-]{36})", result.stdout)
    if not found:
        raise StepError(f"the remote worker's `prefect deployment run` made no flow run: {last_line(result.stderr)}")
    run = stack.wait_flow_run(found.group(1), {"COMPLETED"}, timeout=120)
    if result.returncode != 0:
        raise StepError(f"the remote smoke run: {run['state']['type']}, {last_line(result.stdout + result.stderr)}")
    summary = PipelineSummary.model_validate_json(
        stack.engine("exec", container, "cat", f"{WORKDIR}/summary.json", timeout=60).stdout
    )
    if summary.promotion is None:
        raise StepError("the remote run's summary.json has no promotion")
    version = str(summary.promotion.registered_model_version)
    champion = stack.mlflow("registered-models/alias", name=MODEL_NAME, alias="champion")["model_version"]
    if champion["version"] != version or not summary.promotion.champion:
        raise StepError(f"champion is v{champion['version']}, the remote run registered v{version}")
    artifacts = stack.mlflow("artifacts/list", run_id=champion["run_id"]).get("files", [])
    if not artifacts:
        raise StepError("the remote run's MLflow run lists no artifacts")
    refused = sorted({answer for target, answer in reach.items() if not target.startswith(REMOTE_NAME)})
    row.detail = (
        f"docker/worker-remote.yaml on internal network {remote_network(stack)} (proxy as {REMOTE_NAME!r}): flow "
        f"run {run['name']} COMPLETED in {time.monotonic() - started:.0f} s, registry v{version} champion by the "
        f"gate (told to tolerate any loss), {len(artifacts)} artifact entries via the artifact proxy; postgres, "
        "prefect-server, mlflow by "
        f"name and address: {', '.join(refused)}"
    )


def remove_remote_worker(stack: Stack) -> None:
    """The remote worker's project and network (teardown)."""
    for container in stack.containers(project=stack.remote_project):
        stack.engine("rm", "-f", "-v", container, check=False, timeout=120)
    volumes = stack.engine(
        "volume", "ls", "--format", "{{.Name}}", "--filter", f"label=com.docker.compose.project={stack.remote_project}",
        timeout=60,
    ).stdout.split()  # fmt: skip
    for volume in volumes:
        stack.engine("volume", "rm", "-f", volume, check=False, timeout=120)
