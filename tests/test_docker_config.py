"""Static checks of docker/: the compose file, the Dockerfiles and .dockerignore agree with the repository.

No Docker engine is needed. The compose file is read the way `docker compose config` reads it (YAML plus
`${VAR}` interpolation from docker/.env, here docker/env.example), and every name in it is checked
against what actually reads it: Prefect's settings, `mlflow server`'s options, the postgres image, our
code. `make stack-check` runs the same services for real, in containers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from docker_config import (
    INITDB_DIR,
    POSTGRES_IMAGE_VARIABLES,
    Stage,
    command_of,
    console_scripts,
    copy_instructions,
    effective,
    environment_of,
    exposed_ports,
    healthcheck_ports,
    ignored_by_docker,
    load_compose,
    mlflow_environment_variables,
    mlflow_server_options,
    parse_dockerfile,
    ports_of,
    prefect_setting_names,
    repository_text,
    stage_lineage,
)

from harness import REPO_ROOT
from harness.compose import COMPOSE_FILE, DOCKER_DIR, ENV_EXAMPLE_PATH, SECRET_VARIABLES, read_env_file, variables_used

# --- Tests --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def built_services(compose) -> Iterator[tuple[str, dict[str, Any], Path, list[Stage], list[Stage]]]:
    """(name, service, dockerfile, stages, lineage of the built target) of every service we build."""
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            context = (DOCKER_DIR / build["context"]).resolve()
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            stages = parse_dockerfile(dockerfile)
            yield name, service, dockerfile, stages, stage_lineage(stages, build.get("target"))


def test_compose_services_have_an_image_and_valid_build_sections(compose):
    assert {"postgres", "prefect-server", "mlflow", "worker"} <= set(compose["services"])
    for name, service in compose["services"].items():
        assert service.get("image") or service.get("build"), f"{name} has neither image nor build"
        build = service.get("build")
        if build:
            context = (DOCKER_DIR / build["context"]).resolve()
            assert context == REPO_ROOT, f"{name}: the build context must be the repository root"
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {dockerfile} is missing"
            targets = {stage.name for stage in parse_dockerfile(dockerfile)}
            assert build.get("target") in targets | {None}, f"{name}: no stage {build.get('target')!r} in {dockerfile}"


def test_compose_needs_a_password_and_documents_every_variable():
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    used = variables_used(text)
    documented = read_env_file(ENV_EXAMPLE_PATH)
    assert set(used) <= set(documented), f"undocumented in docker/env.example: {set(used) - set(documented)}"
    for secret in SECRET_VARIABLES:  # Each required (${NAME:?...}) and shipped empty, to be generated.
        assert used[secret] == ":?", f"{secret} must be required (${{{secret}:?...}})"
        assert documented[secret] == "", f"env.example must not ship {secret}"
    with pytest.raises(ValueError, match="POSTGRES_PASSWORD"):
        load_compose(documented)  # Without docker/.env's password, compose refuses to start.
    for name, service in yaml.safe_load(text)["services"].items():
        env_files = service.get("env_file", [])
        for entry in [env_files] if isinstance(env_files, (str, dict)) else env_files:
            path = entry["path"] if isinstance(entry, dict) else entry
            assert (DOCKER_DIR / path).is_file() or (path == ".env" and ENV_EXAMPLE_PATH.is_file()), (name, path)
    git_ignored = (REPO_ROOT / ".gitignore").read_text(encoding="utf-8").split()
    assert "docker/.env" in git_ignored or ".env" in git_ignored


# The all-interfaces bind address, spelt out so the repository-wide grep for it finds only real binds.
ALL_INTERFACES = ".".join(["0"] * 4)


def test_only_the_proxy_publishes_ports_on_loopback_by_default(compose):
    published = 0
    for name, service in compose["services"].items():
        for port in ports_of(service):
            published += 1
            assert name == "proxy", f"{name} publishes {port.target}: only the front door may"
            assert port.host_ip == "127.0.0.1", f"{name} publishes {port.target} on {port.host_ip or 'all interfaces'}"
    assert published == 3  # Prefect, MLflow, the served model.
    # The all-interfaces address is for in-container binds only: nothing outside docker/ binds every interface.
    for folder in ("cifar", "tasks", "flows", "harness", "scripts", "bench"):
        for path in (REPO_ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".sh", ".yaml", ".yml", ".toml"}:
                assert ALL_INTERFACES not in path.read_text(encoding="utf-8", errors="replace"), (
                    f"{path} binds {ALL_INTERFACES}"
                )
    for path in (REPO_ROOT / "prefect.yaml", REPO_ROOT / "Makefile"):
        assert not path.exists() or ALL_INTERFACES not in path.read_text(encoding="utf-8"), (
            f"{path} binds {ALL_INTERFACES}"
        )
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    assert ALL_INTERFACES in text  # In-container binds only; no published port uses it (checked above).


def test_every_service_has_a_health_check_and_dependencies_exist(compose):
    services = compose["services"]
    for name, service in services.items():
        healthcheck = service.get("healthcheck")
        assert healthcheck and healthcheck["test"][0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"
        depends_on = service.get("depends_on", {})
        for dependency in depends_on if isinstance(depends_on, list) else depends_on.items():
            dependency, options = (dependency, {}) if isinstance(dependency, str) else dependency
            assert dependency in services, f"{name} depends on undefined {dependency}"
            if options.get("condition") == "service_healthy":
                assert "healthcheck" in services[dependency]


def test_volumes_are_declared_and_bind_mounts_exist(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (DOCKER_DIR / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in declared, f"{name} uses undeclared volume {source}"
                used.add(source)
    assert used == declared, f"declared but unused volumes: {declared - used}"


# Every Dockerfile of docker/: the pipeline's images and the proxy's.
DOCKERFILES = sorted([*DOCKER_DIR.glob("Dockerfile*"), DOCKER_DIR / "proxy" / "Dockerfile"])


def test_copy_sources_exist_and_are_in_the_build_context():
    for dockerfile in DOCKERFILES:
        copies = list(copy_instructions(parse_dockerfile(dockerfile)))
        assert copies, dockerfile
        for sources, _ in copies:
            for source in sources:
                path = REPO_ROOT / source
                assert path.exists(), f"{dockerfile.name}: COPY {source} does not exist"
                files = [path] if path.is_file() else [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
                for file in files:
                    relative = file.relative_to(REPO_ROOT).as_posix()
                    assert not ignored_by_docker(relative), f"{dockerfile.name}: {relative} is in .dockerignore"


def test_dockerignore_keeps_secrets_and_local_state_out():
    for path in (
        "docker/.env",
        ".env",
        ".venv/bin/python",
        ".git/HEAD",
        "workdir/mlflow.db",
        "mlflow.db",
        "mlartifacts/1/x",
        "cifar/__pycache__/config.cpython-311.pyc",
        "tests/test_config.py",
    ):
        assert ignored_by_docker(path), f"{path} would be sent to the Docker daemon"
    for path in ("pyproject.toml", "constraints.txt", "cifar/config.py", "docker/entrypoint.sh"):
        assert not ignored_by_docker(path), path


def test_images_install_pinned_dependencies_before_the_code_as_a_non_root_user():
    for dockerfile in sorted(DOCKER_DIR.glob("Dockerfile*")):  # The pipeline's images (pip; not the proxy).
        stages = parse_dockerfile(dockerfile)
        final = stage_lineage(stages, None)
        users = [value for stage in final for value in stage.all("USER")]
        assert users and users[-1] not in ("root", "0"), f"{dockerfile.name} runs as root"
        installs = [value for stage in final for value in stage.all("RUN") if "pip install" in value]
        assert installs and all("-c " in value or "--no-deps" in value for value in installs), installs
        order = [
            (instruction, arguments)
            for stage in final
            for instruction, arguments in stage.instructions
            if instruction in ("COPY", "RUN")
        ]
        first_code = next(
            index
            for index, (instruction, arguments) in enumerate(order)
            if instruction == "COPY" and "cifar" in arguments.split()
        )
        dependencies = next(
            index
            for index, (instruction, arguments) in enumerate(order)
            if instruction == "RUN" and "-r " in arguments and "-c " in arguments
        )
        assert dependencies < first_code, f"{dockerfile.name}: the dependency layer must come before the code"
    gpu = (DOCKER_DIR / "Dockerfile.gpu").read_text(encoding="utf-8")
    assert "extras['gpu']" in gpu


def test_image_commands_exist_in_the_image(compose):
    scripts = console_scripts()
    for dockerfile in DOCKERFILES:
        stages = parse_dockerfile(dockerfile)
        apt_installed = " ".join(value for stage in stages for value in stage.all("RUN") if "apt-get install" in value)
        copied = {destination: sources for sources, destination in copy_instructions(stages)}
        for stage in stages:
            lineage = stage_lineage(stages, stage.name) if stage.name else stage_lineage(stages, None)
            entrypoint, cmd = effective(lineage, "ENTRYPOINT"), effective(lineage, "CMD")
            program = (entrypoint or cmd or [None])[0]
            if program is None:
                continue
            if program.startswith("/") or program in {dest.rsplit("/", 1)[-1] for dest in copied}:
                matches = [
                    sources
                    for destination, sources in copied.items()
                    if destination == program or destination.endswith("/" + program)
                ]
                assert matches and all((REPO_ROOT / source).is_file() for source in matches[0]), program
            else:
                installed = scripts | {"python"} | set(apt_installed.split())
                assert program in installed, f"{dockerfile.name}: {program} is not installed"
    for name, service, _, _, lineage in built_services(compose):
        command = command_of(service) or effective(lineage, "CMD")
        entrypoint = effective(lineage, "ENTRYPOINT")
        copied = {destination.rsplit("/", 1)[-1] for _, destination in copy_instructions(lineage)}
        if entrypoint and entrypoint[0] == "cifar-entrypoint":
            script = (DOCKER_DIR / "entrypoint.sh").read_text(encoding="utf-8")
            # `worker` is the entry point's own command; anything else it runs as given (`exec "$@"`).
            assert 'exec "$@"' in script, name
            if command == ["worker"]:
                assert "worker" in script, name
            else:
                assert command and command[0] in scripts | copied, f"{name}: {command} is not an installed program"
        elif name == "proxy":  # Its entry point (certificates) then Caddy, from Debian's packages.
            assert entrypoint == ["proxy-entrypoint"] and command[0] == "caddy", name
        else:
            assert command and command[0] in scripts | copied, f"{name}: {command} is not an installed program"


def test_exposed_ports_match_compose_and_server_settings(compose):
    for name, service, dockerfile, _, lineage in built_services(compose):
        exposed = exposed_ports(lineage)
        wanted = {port.target for port in ports_of(service)} | healthcheck_ports(service)
        assert wanted and wanted <= exposed, f"{name}: ports {wanted - exposed} not EXPOSEd in {dockerfile.name}"
        environment = environment_of(service)
        for variable in ("PREFECT_SERVER_API_PORT", "MLFLOW_PORT", "PREFECT_WORKER_WEBSERVER_PORT"):
            if variable in environment:
                assert int(environment[variable]) in wanted, f"{name}: {variable} is not the port compose uses"


def test_environment_names_are_read_by_something(compose):
    prefect_names = prefect_setting_names()
    mlflow_options = mlflow_server_options()
    mlflow_variables = mlflow_environment_variables()
    code = repository_text(
        "cifar/**/*.py", "tasks/**/*.py", "flows/**/*.py", "docker/entrypoint.sh", "docker/mlflow/*", "docker/proxy/*"
    )
    for name, service in compose["services"].items():
        environment = environment_of(service)
        init_scripts = "\n".join(
            (DOCKER_DIR / volume.split(":")[0]).read_text(encoding="utf-8")
            for volume in service.get("volumes", [])
            if isinstance(volume, str) and INITDB_DIR in volume
        )
        for variable in environment:
            if variable.startswith("PREFECT_"):
                assert variable in prefect_names, f"{name}: {variable} is not a Prefect setting"
            elif variable.startswith("MLFLOW_") and name == "mlflow":  # `mlflow server`, or its start script.
                assert (
                    variable in mlflow_options or variable in mlflow_variables or re.search(rf"\b{variable}\b", code)
                ), f"{name}: neither `mlflow server` nor docker/mlflow/ reads {variable}"
            elif variable.startswith("MLFLOW_"):
                assert variable in mlflow_variables, f"{name}: MLflow does not read {variable}"
            elif variable.startswith("POSTGRES_"):
                assert variable in POSTGRES_IMAGE_VARIABLES, f"{name}: the postgres image does not read {variable}"
            else:
                assert re.search(rf"\b{variable}\b", code + init_scripts), f"{name}: nothing reads {variable}"


def test_servers_use_postgresql_and_the_databases_the_init_script_creates(compose):
    services = compose["services"]
    postgres = environment_of(services["postgres"])
    init_script = (DOCKER_DIR / "postgres-init" / "create-databases.sh").read_text(encoding="utf-8")
    assert "CIFAR_PREFECT_DB" in init_script and "CIFAR_MLFLOW_DB" in init_script
    user, password = postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"]
    prefect_url = environment_of(services["prefect-server"])["PREFECT_API_DATABASE_CONNECTION_URL"]
    mlflow_environment = environment_of(services["mlflow"])
    assert prefect_url == f"postgresql+asyncpg://{user}:{password}@postgres:5432/{postgres['CIFAR_PREFECT_DB']}"
    assert mlflow_environment["MLFLOW_BACKEND_STORE_URI"] == (
        f"postgresql://{user}:{password}@postgres:5432/{postgres['CIFAR_MLFLOW_DB']}"
    )
    assert mlflow_environment["MLFLOW_SERVE_ARTIFACTS"] == "true"
    artifacts = mlflow_environment["MLFLOW_ARTIFACTS_DESTINATION"]
    assert any(str(volume).endswith(":" + artifacts) for volume in services["mlflow"]["volumes"])


def test_worker_talks_to_the_compose_servers_and_serves_the_deployments_pool(compose):
    services = compose["services"]
    for name in ("worker", "worker-gpu"):
        environment = environment_of(services[name])
        assert environment["PREFECT_API_URL"] == "http://prefect-server:4200/api"
        assert environment["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
        assert "mlflow:*" in environment_of(services["mlflow"])["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    pools = {
        deployment["work_pool"]["name"]
        for deployment in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text(encoding="utf-8"))["deployments"]
        if deployment.get("work_pool")
    }
    assert environment_of(services["worker"])["CIFAR_WORK_POOL"] in pools


def test_deployment_entrypoints_are_in_the_worker_images():
    deployments = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text(encoding="utf-8"))["deployments"]
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        stages = parse_dockerfile(DOCKER_DIR / dockerfile)
        copied = [
            source
            for sources, destination in copy_instructions(stage_lineage(stages, None))
            if not destination.startswith("/tmp/")
            for source in sources
        ]
        assert "prefect.yaml" in copied, dockerfile
        for deployment in deployments:
            path = deployment["entrypoint"].split(":")[0]
            assert (REPO_ROOT / path).is_file(), f"{deployment['name']}: {path} does not exist"
            assert any(path == source or path.startswith(source.rstrip("/") + "/") for source in copied), (
                f"{dockerfile} does not copy {path} ({deployment['name']})"
            )
            assert not ignored_by_docker(path), path


def test_build_args_are_declared_and_bases_can_be_replaced(compose):
    """Every compose build arg is an ARG of its Dockerfile; the bases default to the official images."""
    for name, service, dockerfile, stages, _ in built_services(compose):
        text = dockerfile.read_text(encoding="utf-8")
        declared = set(re.findall(r"^ARG\s+([A-Za-z_][A-Za-z0-9_]*)", text, flags=re.MULTILINE))
        assert set(service["build"].get("args") or {}) <= declared, f"{name}: undeclared build args"
        if name == "proxy":
            assert stages[0].parent == "${DEBIAN_IMAGE}", "the proxy's base must be the DEBIAN_IMAGE argument"
            assert "ARG DEBIAN_IMAGE=debian:bookworm-slim" in text
            continue
        assert stages[0].parent == "${PYTHON_IMAGE}", f"{dockerfile.name}: the base must be the PYTHON_IMAGE argument"
        assert "ARG PYTHON_IMAGE=python:${PYTHON_VERSION}-slim-bookworm" in text
    raw = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))["services"]
    assert raw["postgres"]["image"] == "${CIFAR_POSTGRES_IMAGE:-postgres:15-bookworm}"
    documented = read_env_file(ENV_EXAMPLE_PATH)
    assert documented["CIFAR_PYTHON_IMAGE"] == "python:3.11-slim-bookworm"
    assert documented["CIFAR_POSTGRES_IMAGE"] == "postgres:15-bookworm"
    assert documented["CIFAR_DEBIAN_IMAGE"] == "debian:bookworm-slim"


def test_pip_trusts_a_ca_bundle_only_through_a_build_secret():
    """Each pip step may read the `ca` secret (a proxy's CA bundle); no bundle is copied or set in the image."""
    for dockerfile in sorted(DOCKER_DIR.glob("Dockerfile*")):
        stages = parse_dockerfile(dockerfile)
        for stage in stages:
            for run in stage.all("RUN"):
                if "pip install" in run:
                    assert run.startswith("--mount=type=secret,id=ca,target=/run/secrets/ca "), (dockerfile.name, run)
                    assert "PIP_CERT=/run/secrets/ca" in run
            for value in stage.all("ENV"):
                assert "PIP_CERT" not in value and "SSL_CERT_FILE" not in value and "REQUESTS_CA_BUNDLE" not in value
        for sources, _ in copy_instructions(stages):
            assert not any(source.endswith((".crt", ".pem")) for source in sources), dockerfile.name


def test_crashed_flow_runs_are_detected_by_heartbeats(compose):
    """Workers' flow runs send heartbeats; the entry point's automation marks runs whose heartbeats stop CRASHED."""
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    settings = {
        (environment["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"], environment["CIFAR_CRASHED_AFTER_SECONDS"])
        for environment in (environment_of(compose["services"][name]) for name in ("worker", "worker-gpu"))
    }
    [(frequency, window)] = settings  # The same on every worker (compose's defaults here).
    script = (DOCKER_DIR / "entrypoint.sh").read_text(encoding="utf-8")
    assert f"crashed_after=${{CIFAR_CRASHED_AFTER_SECONDS:-{window}}}" in script  # The entry point's default.
    assert 'python flows/worker_setup.py --pool "$pool" --crashed-after "$crashed_after"' in script
    from flows.automations import zombie_automation

    automation = AutomationCore.model_validate(zombie_automation(int(window)).model_dump(mode="json"))
    trigger = automation.trigger
    assert isinstance(trigger, EventTrigger) and trigger.posture == Posture.Proactive
    assert trigger.after == {"prefect.flow-run.heartbeat"} and "prefect.flow-run.heartbeat" in trigger.expect
    # Every final state ends the watch, our Completed states' own names included, and so does a suspension
    # (a run waiting for approval has no process, so no heartbeat).
    final = ("Completed", "Failed", "Cancelled", "Crashed", "Pruned", "Nothing changed", "Approved", "Rejected")
    assert {f"prefect.flow-run.{state}" for state in (*final, "Suspended")} <= trigger.expect
    assert trigger.for_each == {"prefect.resource.id"}
    assert trigger.within.total_seconds() >= 2 * int(frequency), "one late heartbeat must not crash a healthy run"
    [action] = automation.actions
    assert action.type == "change-flow-run-state" and action.state.value == "CRASHED"


def test_the_stack_checks_shorter_timings_are_ones_prefect_accepts():
    """The drills' heartbeat, poll and crash window (scripts/stack_check) as the worker's Prefect reads them."""
    from prefect.settings import Settings

    from scripts.stack_check.context import DRILL_TIMINGS

    heartbeat, window = int(DRILL_TIMINGS["CIFAR_HEARTBEAT_SECONDS"]), int(DRILL_TIMINGS["CIFAR_CRASHED_AFTER_SECONDS"])
    environment = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(heartbeat)}
    environment["PREFECT_WORKER_QUERY_SECONDS"] = DRILL_TIMINGS["CIFAR_WORKER_POLL_SECONDS"]
    with mock.patch.dict(os.environ, environment):
        settings = Settings()  # A value Prefect refuses (a heartbeat under 30 s) stops the worker's start here.
    assert settings.flows.heartbeat_frequency == heartbeat and settings.worker.query_seconds == 1
    assert window >= 2 * heartbeat, "one late heartbeat must not crash a healthy run"


def test_postgres_standin_keeps_the_official_image_contract(compose):
    """The stand-in built where postgres:15-bookworm cannot be pulled reads what compose gives the official one."""
    standin = (DOCKER_DIR / "standins" / "postgres.Dockerfile").read_text(encoding="utf-8")
    entrypoint = (DOCKER_DIR / "standins" / "postgres-entrypoint.sh").read_text(encoding="utf-8")
    service = compose["services"]["postgres"]
    data_volume = next(volume for volume in service["volumes"] if not volume.startswith("."))
    assert re.search(rf"PGDATA={re.escape(data_volume.split(':')[1])}\b", standin)
    for variable in environment_of(service):
        if variable.startswith("POSTGRES_"):
            assert variable in entrypoint, f"the stand-in ignores {variable}"
    assert f"{INITDB_DIR}/*" in entrypoint and "--encoding=UTF8 --locale=C.UTF-8" in entrypoint
    assert "setpriv --reuid=postgres" in entrypoint  # The server never runs as root.
    check = " ".join(service["healthcheck"]["test"])
    assert check.split()[1] == "pg_isready"


def test_stack_env_generates_each_missing_secret_once_and_keeps_the_rest(tmp_path):
    """`make stack-env`: docker/.env from env.example with every secret generated (owner-only); run again, it
    keeps what is there and fills in only a secret that is missing or empty."""
    from harness.compose import fill_env_file

    env_file = tmp_path / ".env"
    generated = fill_env_file(env_file)
    values = read_env_file(env_file)
    assert set(generated) == set(SECRET_VARIABLES) and all(values[name] == generated[name] for name in generated)
    assert env_file.stat().st_mode & 0o777 == 0o600
    assert generated["PREFECT_AUTH_STRING"].startswith("cifar:") and len(generated["MLFLOW_ADMIN_PASSWORD"]) >= 12
    assert len(set(generated.values())) == len(generated)  # Each its own.
    assert values["MLFLOW_VIEWER_USERNAME"] == "viewer"  # env.example's other settings and comments stay.
    assert "# Secrets" in env_file.read_text(encoding="utf-8")

    env_file.write_text(
        env_file.read_text(encoding="utf-8").replace(f"SERVE_PASSWORD={generated['SERVE_PASSWORD']}", "SERVE_PASSWORD=")
    )
    again = fill_env_file(env_file)
    assert list(again) == ["SERVE_PASSWORD"]
    assert {name: value for name, value in read_env_file(env_file).items() if name != "SERVE_PASSWORD"} == {
        name: value for name, value in values.items() if name != "SERVE_PASSWORD"
    }
    assert fill_env_file(env_file) == {}
