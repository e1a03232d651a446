"""The production stack of docker/compose.yaml, run for real without Docker.

A throwaway PostgreSQL (scripts/postgres.sh) gets its databases from the compose file's init script;
the Prefect server, the MLflow server and the worker then run with the commands, environments and
health checks that docker/compose.yaml and docker/Dockerfile give them. Only what Docker itself would
change is rewritten: service names and container ports become 127.0.0.1 and free ports, container
paths (volumes, the image's HOME) become temporary directories. So a setting that breaks the stack
breaks this test, and the compose file cannot drift away from what is tested.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_docker_config import (
    ALL_INTERFACES,
    Stage,
    command_of,
    copy_instructions,
    effective,
    environment_of,
    load_compose,
    parse_dockerfile,
    stage_lineage,
)

from cifar.summary import PipelineSummary
from harness import REPO_ROOT
from harness.compose import DOCKER_DIR, ENV_EXAMPLE_PATH, generate_secrets, read_env_file
from harness.ports import HOST, free_port
from harness.postgres import install_postgres, postgres_cluster
from harness.prefect import prefect_env
from harness.processes import BIN_DIR, ProcessHandle, spawn

_POSTGRES_MISSING = install_postgres()

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        _POSTGRES_MISSING is not None, reason=f"PostgreSQL cannot be installed on this machine: {_POSTGRES_MISSING}"
    ),
]


# --- The compose file, localized ----------------------------------------------------------------------


@dataclass
class Stack:
    """docker/compose.yaml interpolated for this test, and where each service lives on this machine."""

    services: dict[str, Any]
    ports: dict[str, int]  # "service:container port" -> local port
    root: Path  # Temporary directory standing in for volumes and the image's HOME.

    def localize(self, text: str, service: str) -> str:
        """Rewrites what Docker would provide: service addresses, the service's own ports, container paths."""
        for address, port in self.ports.items():
            text = text.replace(address, f"{HOST}:{port}")
        for address, port in self.ports.items():
            name, container_port = address.split(":")
            if name == service:
                text = text.replace(f"{HOST}:{container_port}", f"{HOST}:{port}")
                text = text.replace(f"localhost:{container_port}", f"localhost:{port}")
                if text == container_port:
                    text = str(port)
        text = text.replace(ALL_INTERFACES, HOST)  # In-container binds become loopback binds here.
        for container_path, local_path in self.paths(service).items():
            text = text.replace(container_path, str(local_path))
        return text

    def container_path(self, service: str, path: str) -> Path:
        """Where a path inside `service`'s container lives on this machine."""
        return self.root / "containers" / service / path.lstrip("/")

    def paths(self, service: str) -> dict[str, Path]:
        """Container path -> local directory: the service's named volumes, then the image's home."""
        paths = {}
        for volume in self.services[service].get("volumes", []):
            source, target = str(volume).split(":")[:2]
            if not source.startswith((".", "/")):
                paths[target] = self.container_path(service, target)
        paths["/home/cifar"] = self.container_path(service, "/home/cifar")
        return paths

    def lineage(self, service: str) -> list[Stage]:
        build = self.services[service]["build"]
        stages = parse_dockerfile((DOCKER_DIR / build["context"] / build["dockerfile"]).resolve())
        return stage_lineage(stages, build.get("target"))

    def install_image_files(self, service: str) -> Path:
        """Copies what the image's Dockerfile COPYs from the repository into the container's tree.

        Returns the image's WORKDIR there. The dependency layer's files (under /tmp) are left out:
        this machine's venv stands in for that layer.
        """
        lineage = self.lineage(service)
        workdir = [value for stage in lineage for value in stage.all("WORKDIR")][-1]
        for sources, destination in copy_instructions(lineage):
            destination = destination if destination.startswith("/") else f"{workdir}/{destination}"
            if destination.startswith("/tmp/"):
                continue
            for source in sources:
                origin = REPO_ROOT / source
                target = self.container_path(service, destination)
                if destination.endswith("/") or len(sources) > 1:
                    target = target / origin.name if origin.is_file() else target
                target.parent.mkdir(parents=True, exist_ok=True)
                if origin.is_dir():
                    shutil.copytree(
                        origin, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
                    )
                else:
                    shutil.copy2(origin, target)
        return self.container_path(service, workdir)

    def image_environment(self, service: str) -> dict[str, str]:
        """The ENV of the service's image (PATH and the venv are this machine's)."""
        environment = {}
        for stage in self.lineage(service):
            for value in stage.all("ENV"):
                for pair in value.split():
                    key, _, item = pair.partition("=")
                    environment[key] = item
        return {key: value for key, value in environment.items() if key not in ("PATH", "VIRTUAL_ENV", "HOME")}

    def process_environment(self, service: str, **extra: str) -> dict[str, str]:
        """What a process of `service` sees: image ENV + the service's environment, localized."""
        environment = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("PREFECT_", "MLFLOW_", "PG", "POSTGRES_")) and key != "PWD"
        }
        environment.update(self.image_environment(service))
        environment.update(environment_of(self.services[service]))
        environment = {key: self.localize(value, service) for key, value in environment.items()}
        for path in self.paths(service).values():
            path.mkdir(parents=True, exist_ok=True)
        environment["HOME"] = str(self.paths(service)["/home/cifar"])
        # The image's own programs (the entry point), then this machine's venv in place of /opt/venv.
        image_bin = self.container_path(service, "/usr/local/bin")
        environment["PATH"] = os.pathsep.join([str(image_bin), str(BIN_DIR), os.environ.get("PATH", "")])
        environment["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
        environment.update(extra)
        return environment

    def argv(self, words: list[str], environment: dict[str, str]) -> list[str]:
        program = shutil.which(words[0], path=environment["PATH"])
        assert program, f"{words[0]} is not installed here"
        return [program, *words[1:]]

    def healthy(self, service: str, environment: dict[str, str]) -> bool:
        """Runs the service's compose health check on this machine, once."""
        test = [self.localize(word, service) for word in self.services[service]["healthcheck"]["test"]]
        argv = ["sh", "-c", test[1]] if test[0] == "CMD-SHELL" else self.argv(test[1:], environment)
        try:
            return subprocess.run(argv, env=environment, capture_output=True, timeout=30).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait_healthy(
        self, service: str, environment: dict[str, str], handle: ProcessHandle | None, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if handle is not None and not handle.alive():
                raise RuntimeError(f"{service} exited with {handle.process.returncode}:\n{handle.logs()[-6000:]}")
            if self.healthy(service, environment):
                return
            time.sleep(2)
        logs = handle.logs()[-6000:] if handle else ""
        raise TimeoutError(f"{service} not healthy after {timeout:.0f}s:\n{logs}")

    def start(
        self, service: str, argv: list[str], *, cwd: Path | None = None, timeout: float = 240, **extra: str
    ) -> ProcessHandle:
        """Starts `argv` as `service` and waits until the service's own health check passes."""
        environment = self.process_environment(service, **extra)
        log_path = self.root / "logs" / f"{service}.log"
        handle = spawn(self.argv(argv, environment), environment, log_path, cwd=cwd)
        try:
            self.wait_healthy(service, environment, handle, timeout)
        except BaseException:
            handle.stop()
            raise
        return handle


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    root = tmp_path_factory.mktemp("stack")
    ports = {
        "postgres:5432": free_port(),
        "prefect-server:4200": free_port(),
        "mlflow:5000": free_port(),
        "worker:8080": free_port(),
    }
    variables = read_env_file(ENV_EXAMPLE_PATH)
    variables.update(generate_secrets(variables))  # As `make stack-env` does.
    variables.update(
        PREFECT_HOST_PORT=str(ports["prefect-server:4200"]),
        MLFLOW_HOST_PORT=str(ports["mlflow:5000"]),
        MLFLOW_WORKERS="1",  # Two shared CPU cores.
    )
    return Stack(load_compose(variables)["services"], ports, root)


@dataclass
class Postgres:
    port: int
    user: str
    password: str

    def connect(self, database: str):
        import psycopg2

        return psycopg2.connect(host=HOST, port=self.port, user=self.user, password=self.password, dbname=database)

    def query(self, database: str, sql: str, *parameters: Any) -> list[tuple]:
        connection = self.connect(database)
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql, parameters)
                return cursor.fetchall()
        finally:
            connection.close()


@pytest.fixture(scope="module")
def postgres(stack: Stack) -> Iterator[Postgres]:
    """A PostgreSQL server on 127.0.0.1 with the databases compose's init script creates."""
    service = environment_of(stack.services["postgres"])
    port = stack.ports["postgres:5432"]
    with postgres_cluster(port, user=service["POSTGRES_USER"], password=service["POSTGRES_PASSWORD"]):
        client = {
            **os.environ,
            **service,
            "PGHOST": HOST,
            "PGPORT": str(port),
            "PGPASSWORD": service["POSTGRES_PASSWORD"],
        }
        init_script = next(
            str(volume).split(":")[0]
            for volume in stack.services["postgres"]["volumes"]
            if "docker-entrypoint-initdb.d" in str(volume)
        )
        _run(["bash", str(DOCKER_DIR / init_script)], client, timeout=60)
        assert stack.healthy("postgres", client), "the compose health check fails against this server"
        yield Postgres(port, service["POSTGRES_USER"], service["POSTGRES_PASSWORD"])


@pytest.fixture(scope="module")
def prefect_server(stack: Stack, postgres: Postgres) -> Iterator[str]:
    """The Prefect server as compose runs it; yields its API URL."""
    # The one setting added to compose's: no scheduler, so prefect.yaml's nightly schedule can never
    # hand the test's worker a full training run.
    handle = stack.start(
        "prefect-server",
        command_of(stack.services["prefect-server"]),
        PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false",
    )
    yield f"http://{HOST}:{stack.ports['prefect-server:4200']}/api"
    handle.stop()


@pytest.fixture(scope="module")
def mlflow_server(stack: Stack, postgres: Postgres) -> Iterator[str]:
    """The MLflow tracking server as compose runs it (with its basic-auth app and the service accounts that
    docker/mlflow/ sets up); yields its URL (the tracking URI)."""
    stack.install_image_files("mlflow")
    handle = stack.start("mlflow", command_of(stack.services["mlflow"]))
    yield f"http://{HOST}:{stack.ports['mlflow:5000']}"
    handle.stop()


def _run(argv: list[str], environment: dict[str, str], timeout: float) -> None:
    result = subprocess.run(argv, env=environment, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def _get(url: str, auth: tuple[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, ""


def worker_signs_in(stack: Stack, monkeypatch) -> dict[str, str]:
    """This process's MLflow client as the workers' service account; the Prefect auth string, for clients."""
    worker = environment_of(stack.services["worker"])
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, worker[name])
    return {"PREFECT_API_AUTH_STRING": worker["PREFECT_API_AUTH_STRING"]}


# --- Tests --------------------------------------------------------------------------------------------


def test_prefect_server_keeps_flow_runs_in_postgresql(stack, postgres, prefect_server, tmp_path, monkeypatch):
    status, page = _get(prefect_server.removesuffix("/api") + "/")
    assert status == 200 and "<html" in page.lower()  # The UI is served (its bundle lives under HOME).
    assert _get(prefect_server + "/deployments/name/cifar/smoke")[0] == 401  # No data without the auth string.
    auth = worker_signs_in(stack, monkeypatch)
    probe = (
        "from prefect import flow\n"
        "@flow(name='postgres-probe')\n"
        "def probe(value: int) -> int:\n"
        "    return value * 2\n"
        "state = probe(21, return_state=True)\n"
        "print(state.state_details.flow_run_id, state.result())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env=prefect_env(tmp_path / "client", prefect_server, **auth),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    flow_run_id, value = result.stdout.split()[-2:]
    assert value == "42"
    database = environment_of(stack.services["postgres"])["CIFAR_PREFECT_DB"]
    rows = postgres.query(
        database,
        "SELECT fr.state_type, f.name FROM flow_run fr JOIN flow f ON f.id = fr.flow_id WHERE fr.id = %s",
        flow_run_id,
    )
    assert rows == [("COMPLETED", "postgres-probe")]


def test_mlflow_server_keeps_runs_and_models_in_postgresql_and_artifacts_on_the_volume(
    stack, postgres, mlflow_server, tmp_path, monkeypatch
):
    import mlflow

    assert _get(mlflow_server + "/")[0] == 401  # Nothing without signing in, the UI included.
    viewer = environment_of(stack.services["mlflow"])
    status, page = _get(mlflow_server + "/", (viewer["MLFLOW_VIEWER_USERNAME"], viewer["MLFLOW_VIEWER_PASSWORD"]))
    assert status == 200 and "<html" in page.lower()
    worker_signs_in(stack, monkeypatch)
    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    experiment_id = client.create_experiment("postgres-probe")
    run = client.create_run(experiment_id)
    client.log_metric(run.info.run_id, "accuracy", 0.5, step=1)
    report = tmp_path / "report.txt"
    report.write_text("stored through the server\n")
    client.log_artifact(run.info.run_id, str(report))
    client.set_terminated(run.info.run_id)
    client.create_registered_model("postgres-probe-model")
    version = client.create_model_version(
        "postgres-probe-model", f"runs:/{run.info.run_id}/report.txt", run_id=run.info.run_id
    )

    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # Served by the server, not a client path.
    assert [artifact.path for artifact in client.list_artifacts(run.info.run_id)] == ["report.txt"]
    volume = stack.paths("mlflow")[environment_of(stack.services["mlflow"])["MLFLOW_ARTIFACTS_DESTINATION"]]
    assert [path.read_text() for path in volume.rglob("report.txt")] == ["stored through the server\n"]

    database = environment_of(stack.services["postgres"])["CIFAR_MLFLOW_DB"]
    assert postgres.query(database, "SELECT key, value FROM metrics WHERE run_uuid = %s", run.info.run_id) == [
        ("accuracy", 0.5)
    ]
    assert postgres.query(database, "SELECT name FROM registered_models WHERE name = %s", "postgres-probe-model") == [
        ("postgres-probe-model",)
    ]
    assert postgres.query(
        database, "SELECT version, run_id FROM model_versions WHERE name = %s", "postgres-probe-model"
    ) == [(int(version.version), run.info.run_id)]


def test_smoke_deployment_runs_through_the_compose_worker_into_postgresql(
    stack, postgres, prefect_server, mlflow_server, tmp_path, monkeypatch
):
    """The worker service's entry point deploys prefect.yaml and runs `cifar/smoke` on a generated archive."""
    import mlflow

    from cifar.data.synthetic import build_archive
    from cifar.io import file_digest

    archive = build_archive(tmp_path / "cifar-10-python.tar.gz", train_per_batch=60, test_examples=100)
    app = stack.install_image_files("worker")
    worker_command = effective(stack.lineage("worker"), "ENTRYPOINT") + command_of(stack.services["worker"])
    worker = stack.start("worker", worker_command, cwd=app, timeout=600)
    try:
        # Tiny settings: the point is the path through the servers, not the model.
        parameters = {
            "config": {
                "preset": "smoke",
                "data": {
                    "source": str(archive),
                    "sha256": file_digest(archive),
                    "validation_size": 60,
                    "expect_official_counts": False,
                    "train_shards": 2,
                    "test_shards": 1,
                },
                "train": {"model": "tiny", "epochs": 1, "steps_per_epoch": 2, "batch_size": 32, "shuffle_buffer": 256},
                "evaluate": {"batch_size": 100, "misclassified_examples": 4},
            }
        }
        client = prefect_env(tmp_path / "client", prefect_server, **worker_signs_in(stack, monkeypatch))
        result = subprocess.run(
            [
                str(BIN_DIR / "prefect"),
                "deployment",
                "run",
                "cifar/smoke",
                "--params",
                json.dumps(parameters),
                "--watch",
                "--watch-timeout",
                "900",
            ],
            env=client,
            capture_output=True,
            text=True,
            timeout=960,
        )
        assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{worker.logs()[-6000:]}"
    finally:
        worker.stop()

    prefect_database = environment_of(stack.services["postgres"])["CIFAR_PREFECT_DB"]
    runs = postgres.query(
        prefect_database,
        (
            "SELECT fr.state_type, f.name FROM flow_run fr JOIN deployment d ON d.id = fr.deployment_id "
            "JOIN flow f ON f.id = fr.flow_id WHERE d.name = %s"
        ),
        "smoke",
    )
    assert runs == [("COMPLETED", "cifar")]
    summary = PipelineSummary.read(app / "workdir" / "summary.json")  # On the worker's workdir volume.
    assert summary.preset == "smoke"

    tracking = mlflow.MlflowClient(tracking_uri=mlflow_server)
    experiment = tracking.get_experiment_by_name("cifar10")
    [run] = tracking.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    assert tracking.list_artifacts(run.info.run_id), "no artifacts reached the MLflow server"
    artifacts_volume = stack.paths("mlflow")[environment_of(stack.services["mlflow"])["MLFLOW_ARTIFACTS_DESTINATION"]]
    assert any(path.is_file() for path in (artifacts_volume / experiment.experiment_id / run.info.run_id).rglob("*"))
    mlflow_database = environment_of(stack.services["postgres"])["CIFAR_MLFLOW_DB"]
    metric_keys = {
        key
        for (key,) in postgres.query(
            mlflow_database, "SELECT DISTINCT key FROM metrics WHERE run_uuid = %s", run.info.run_id
        )
    }
    assert set(run.data.metrics) <= metric_keys and "test_accuracy" in metric_keys
    assert postgres.query(mlflow_database, "SELECT name FROM registered_models WHERE name = %s", "cifar10") == [
        ("cifar10",)
    ]
    assert postgres.query(mlflow_database, "SELECT run_id FROM model_versions WHERE name = %s", "cifar10") == [
        (run.info.run_id,)
    ]
