"""One compose project of docker/compose.yaml: its containers, their health, and the servers' REST APIs through
the front door (TLS verified against the stack's own CA, with the services' credentials)."""

from __future__ import annotations

import contextlib
import json
import re
import ssl
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx

from harness import REPO_ROOT
from harness.compose import COMPOSE_FILE, write_env_file
from harness.digests import archive_sha256
from harness.ports import HOST
from harness.prefect import BusyRetryingTransport
from scripts.stack_check.engine import Engine
from scripts.stack_check.shell import StepError, last_line, wait_until

DATA_MOUNT = "/data"  # Where compose mounts CIFAR_DATA_DIR in the workers.
WORKDIR = "/app/workdir"  # The `workdir` volume in the workers.
ARTIFACTS = "/srv/mlartifacts"  # The `mlartifacts` volume in the MLflow server.
CA_IN_PROXY = "/certs/ca.crt"  # The local CA's certificate, made by the proxy on its first start.
FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def archive_parameters(archive: Path) -> dict[str, Any]:
    """The archive as the workers see it: in the read-only /data mount, with its SHA-256."""
    return {"source": f"{DATA_MOUNT}/{archive.name}", "sha256": archive_sha256(archive)}


class Stack:
    """A throwaway compose project of docker/compose.yaml, its env file holding `variables`."""

    def __init__(self, engine: Engine, project: str, env_file: Path, variables: dict[str, str]):
        self.engine = engine
        self.project = project
        self.env_file = env_file
        self.variables = variables
        self.prefect_url = f"https://{HOST}:{variables['PREFECT_HOST_PORT']}/api"
        self.mlflow_url = f"https://{HOST}:{variables['MLFLOW_HOST_PORT']}"
        self.serve_url = f"https://{HOST}:{variables['SERVE_HOST_PORT']}"
        self.ca_file = env_file.with_name("ca.crt")  # Copied out of the proxy once it is up.
        self._client: httpx.Client | None = None

    def credentials(self, service: str) -> tuple[str, str]:
        """(user, password) of `service`: prefect, mlflow-admin, mlflow-worker, mlflow-viewer or serve."""
        variables = self.variables
        if service == "prefect":
            user, _, password = variables["PREFECT_AUTH_STRING"].partition(":")
            return user, password
        if service == "serve":
            return variables.get("SERVE_USERNAME") or "client", variables["SERVE_PASSWORD"]
        role = service.removeprefix("mlflow-").upper()
        defaults = {"ADMIN": "admin", "WORKER": "cifar-worker", "VIEWER": "viewer"}
        return variables.get(f"MLFLOW_{role}_USERNAME") or defaults[role], variables[f"MLFLOW_{role}_PASSWORD"]

    def set_variable(self, name: str, value: str) -> None:
        """Changes one variable of the compose project's env file (the next `up` recreates what it changes)."""
        self.variables[name] = value
        write_env_file(self.env_file, self.variables)

    def compose(self, *args: str, profiles: tuple[str, ...] = (), timeout: float = 900, check: bool = True):
        argv = [*self.engine.compose_command(), "--env-file", self.env_file, "-p", self.project, "-f", COMPOSE_FILE]
        for profile in profiles:
            argv += ["--profile", profile]
        return self.engine.shell.run([*argv, *args], env=self.engine.env, timeout=timeout, check=check, cwd=REPO_ROOT)

    @property
    def remote_project(self) -> str:
        """The compose project of the worker "on another machine" (scripts/stack_check/remote.py)."""
        return f"{self.project}-remote"

    def containers(self, service: str | None = None, all: bool = True, project: str | None = None) -> list[str]:
        label = f"label=com.docker.compose.project={project or self.project}"
        argv = ["ps", "--format", "{{.Names}}", "--filter", label]
        if all:
            argv.append("-a")
        if service:
            argv += ["--filter", f"label=com.docker.compose.service={service}"]
        return sorted(line for line in self.engine(*argv, timeout=60).stdout.split() if line)

    def container(self, service: str, index: int = 0, *, running: bool = False) -> str:
        names = self.containers(service, all=not running)
        if len(names) <= index:
            raise StepError(f"no {'running ' if running else ''}container {index + 1} of service {service}")
        return names[index]

    def exec(self, service: str, *argv: str, index: int = 0, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        # Among the running containers only: a drill may have stopped one of the service's (the workers
        # share the workdir volume, so any running one reads the same files).
        interactive = ["-i"] if kwargs.get("input") is not None else []
        return self.engine("exec", *interactive, self.container(service, index, running=True), *argv, **kwargs)

    def state(self, container: str) -> str:
        result = self.engine("inspect", "--format", "{{.State.Status}}", container, check=False, timeout=60)
        return result.stdout.strip() if result.returncode == 0 else "missing"

    def logs(self, container: str, *options: str) -> str:
        result = self.engine("logs", *options, container, check=False, timeout=120)
        return result.stdout + result.stderr

    def healthy(self, container: str) -> bool:
        if self.engine.name == "podman":  # No systemd timers here: run the container's health check now.
            return self.engine("healthcheck", "run", container, check=False, timeout=60).returncode == 0
        status = self.engine("inspect", "--format", "{{.State.Health.Status}}", container, check=False, timeout=60)
        return status.stdout.strip() == "healthy"

    def wait_healthy(self, services: list[str], timeout: float) -> None:
        containers = [name for service in services for name in self.containers(service)]
        if not containers:
            raise StepError(f"no containers for {', '.join(services)}")
        self.wait_healthy_containers(containers, timeout)

    def wait_healthy_containers(self, containers: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = list(containers)
        while waiting:
            for container in list(waiting):
                if self.healthy(container):
                    waiting.remove(container)
                elif self.state(container) in ("exited", "dead", "missing"):
                    raise StepError(f"{container} stopped: {last_line(self.logs(container, '--tail', '30'))}")
            if waiting and time.monotonic() > deadline:
                raise StepError(f"not healthy after {timeout:.0f}s: {', '.join(waiting)}")
            if waiting:
                time.sleep(1)  # Each look runs the health check once (a second or less); the stack waits ~20 times.

    def up(self) -> float:
        """Starts the stack in dependency order, each service once the ones it needs are healthy (podman-compose
        does not wait for `service_healthy`, and Podman without systemd runs no health checks by itself)."""
        started = time.monotonic()
        self.compose("up", "-d", "postgres")
        self.wait_healthy(["postgres"], 180)
        self.compose("up", "-d", "prefect-server", "mlflow")
        self.wait_healthy(["prefect-server", "mlflow"], 420)
        self.compose("up", "-d", "proxy", "worker")
        self.wait_healthy(["proxy"], 120)
        self.trust_front_door()
        self.wait_healthy(["worker"], 600)
        return time.monotonic() - started

    def trust_front_door(self) -> None:
        """The proxy's CA certificate into `ca_file`, and a client that verifies the front door with it."""
        self.ca_file.write_text(self.exec("proxy", "cat", CA_IN_PROXY, timeout=60).stdout, encoding="utf-8")
        context = ssl.create_default_context(cafile=str(self.ca_file))
        self._client = httpx.Client(transport=BusyRetryingTransport(verify=context), timeout=60)

    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            self.trust_front_door()
        return self._client

    def down(self, volumes: bool = False) -> None:
        args = ["down", "--timeout", "20"] + (["-v"] if volumes else [])
        self.compose(*args, profiles=("serve",), timeout=600)

    def record_logs(self) -> None:
        """Each container's last log lines into the command log (before the stack is removed)."""
        with contextlib.suppress(StepError):
            for container in self.containers():
                self.engine.shell.write(f"\n===== logs of {container} =====\n{self.logs(container, '--tail', '200')}")

    def pause_nightly(self) -> None:
        """Pauses the nightly schedule (a full training at 02:00 UTC would compete with the checks)."""
        with contextlib.suppress(StepError):
            deployment = self.deployment("cifar/nightly")
            if not deployment.get("paused"):
                self.prefect("PATCH", f"/deployments/{deployment['id']}", {"paused": True})

    # The servers' REST APIs, through the front door's published 127.0.0.1 ports.

    def http(self, method: str, url: str, body: Any = None, *, auth: tuple[str, str] | None = None) -> Any:
        response = self.client.request(method, url, json=body, auth=auth)
        if response.is_error:
            raise StepError(f"{method} {url}: HTTP {response.status_code} {response.content[:300]!r}")
        return response.json() if response.content else None

    def prefect(self, method: str, path: str, body: Any = None) -> Any:
        return self.http(method, self.prefect_url + path, body, auth=self.credentials("prefect"))

    def mlflow(self, path: str, *, account: str = "mlflow-admin", **query: str) -> Any:
        url = f"{self.mlflow_url}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(query)}"
        return self.http("GET", url, auth=self.credentials(account))

    def deployment(self, name: str) -> dict[str, Any]:
        """The deployment `flow/deployment` as Prefect's API describes it."""
        return self.prefect("GET", f"/deployments/name/{name}")

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        return self.prefect("GET", f"/flow_runs/{flow_run_id}")

    def flow_run_logs(self, flow_run_id: str) -> list[str]:
        messages, offset = [], 0
        while True:
            query = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200}
            page = self.prefect("POST", "/logs/filter", {**query, "offset": offset})
            messages += [entry["message"] for entry in page]
            if len(page) < 200:
                return messages
            offset += 200

    def psql(self, database: str, sql: str) -> list[list[str]]:
        user = self.variables.get("POSTGRES_USER") or "cifar"
        result = self.exec("postgres", "psql", "-U", user, "-d", database, "-tAqF", "\t", "-c", sql, timeout=60)
        return [line.split("\t") for line in result.stdout.splitlines() if line.strip()]

    def read_json(self, service: str, path: str, index: int = 0) -> Any:
        result = self.exec(service, "cat", path, index=index, check=False, timeout=60)
        if result.returncode != 0:
            return None
        try:
            return json.loads(result.stdout)
        except json.JSONDecodeError:
            return None

    def deployment_run(
        self,
        deployment: str,
        parameters: dict[str, Any],
        *,
        watch: bool,
        timeout: float = 1500,
        command_line: bool = False,
        index: int = 0,
    ) -> str:
        """A flow run of `deployment` (`flow/deployment`) with `parameters`; its id. `watch`: returned when it has
        ended. Through the API (what `prefect deployment run` posts), or with `command_line` the README's own
        `prefect deployment run` inside worker container `index`: one drill proves the command, the others spare
        a Prefect process each (~3 CPU-s in a container, 9 of them a check)."""
        if not command_line:
            deployment_id = self.deployment(deployment)["id"]
            created = self.prefect("POST", f"/deployments/{deployment_id}/create_flow_run", {"parameters": parameters})
            if watch:
                self.wait_flow_run(created["id"], FINAL_STATES, timeout)
            return created["id"]
        argv = ["prefect", "deployment", "run", deployment, "--params", json.dumps(parameters)]
        if watch:
            argv += ["--watch", "--watch-timeout", str(int(timeout))]
        result = self.exec("worker", *argv, index=index, check=False, timeout=timeout + 120)
        found = re.search(r"UUID:\s*([0-9a-f-]{36})", result.stdout)
        if not found:
            raise StepError(f"`prefect deployment run {deployment}` made no flow run: {last_line(result.stderr)}")
        return found.group(1)

    def wait_flow_run(self, flow_run_id: str, states: set[str], timeout: float) -> dict[str, Any]:
        def probe():
            run = self.flow_run(flow_run_id)
            state = run["state"]["type"]
            if state in states:
                return run
            if state in FINAL_STATES:
                raise StepError(f"flow run {run['name']} ended {state}: {run['state'].get('message')}")
            return None

        # Every second: one small API read, and each drill waits for several flow runs (3 s cost ~1.5 s per wait).
        return wait_until(f"flow run {flow_run_id} in {'/'.join(sorted(states))}", probe, timeout, interval=1)
