"""Readers for tests/test_docker_config.py: the compose file as `docker compose config` reads it, the Dockerfiles'
stages, .dockerignore's patterns, and the names that Prefect, `mlflow server`, the postgres image and our code
read. Plain functions over the repository's files; no Docker engine.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.metadata
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness import REPO_ROOT
from harness.compose import COMPOSE_FILE, ENV_EXAMPLE_PATH, generate_secrets, interpolate_tree, read_env_file

# Variables the official postgres image reads (https://hub.docker.com/_/postgres, "Environment Variables").
POSTGRES_IMAGE_VARIABLES = {
    "POSTGRES_USER",
    "POSTGRES_PASSWORD",
    "POSTGRES_DB",
    "POSTGRES_INITDB_ARGS",
    "POSTGRES_INITDB_WALDIR",
    "POSTGRES_HOST_AUTH_METHOD",
    "PGDATA",
}
INITDB_DIR = "/docker-entrypoint-initdb.d"


# --- Compose: loading -----------------------------------------------------------------------------------


def load_compose(variables: dict[str, str] | None = None) -> dict[str, Any]:
    """docker/compose.yaml interpolated with `variables` (default: docker/env.example, its secrets generated as
    `make stack-env` generates them)."""
    if variables is None:
        variables = read_env_file(ENV_EXAMPLE_PATH)
        variables.update(generate_secrets(variables))
    return interpolate_tree(yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8")), variables)


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    """A service's `environment` as a dict (compose allows a mapping or a list of KEY=VALUE)."""
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {key: "" if value is None else str(value) for key, value in environment.items()}


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


@dataclass
class Port:
    host_ip: str | None
    published: str | None
    target: int


def ports_of(service: dict[str, Any]) -> list[Port]:
    """Published ports in short (`IP:HOST:CONTAINER`) or long (mapping) syntax."""
    ports = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            ports.append(Port(entry.get("host_ip"), str(entry.get("published")), int(entry["target"])))
            continue
        parts = str(entry).split("/")[0].split(":")
        if len(parts) == 3:
            ports.append(Port(parts[0], parts[1], int(parts[2])))
        elif len(parts) == 2:
            ports.append(Port(None, parts[0], int(parts[1])))
        else:
            ports.append(Port(None, None, int(parts[0])))
    return ports


def healthcheck_ports(service: dict[str, Any]) -> set[int]:
    """Ports a service's health check probes on its own loopback (http://127.0.0.1:PORT/...)."""
    test = " ".join(service.get("healthcheck", {}).get("test", []))
    return {int(port) for port in re.findall(r"//(?:127\.0\.0\.1|localhost):(\d+)", test)}


# --- Dockerfiles --------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str | None
    parent: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [arguments for instruction, arguments in self.instructions if instruction == keyword]


def parse_dockerfile(path: Path) -> list[Stage]:
    """Stages with their instructions (continuation lines joined, comments dropped)."""
    logical, pending = [], ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        if not pending and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.lstrip().startswith("#"):  # A comment inside a continued instruction.
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        logical.append(pending + raw)
        pending = ""
    stages: list[Stage] = []
    for line in logical:
        instruction, _, arguments = line.strip().partition(" ")
        instruction, arguments = instruction.upper(), arguments.strip()
        if instruction == "FROM":
            words = arguments.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(name, words[0]))
        elif stages:
            stages[-1].instructions.append((instruction, arguments))
    return stages


def stage_lineage(stages: list[Stage], target: str | None) -> list[Stage]:
    """The stage `target` (default: the last) and the stages it is built FROM, base first."""
    by_name = {stage.name: stage for stage in stages if stage.name}
    stage = by_name[target] if target else stages[-1]
    lineage = [stage]
    while stage.parent in by_name:
        stage = by_name[stage.parent]
        lineage.insert(0, stage)
    return lineage


def copy_instructions(stages: list[Stage]) -> Iterator[tuple[list[str], str]]:
    """(sources, destination) of every COPY/ADD from the build context (not `--from=` another stage)."""
    for stage in stages:
        for instruction, arguments in stage.instructions:
            if instruction not in ("COPY", "ADD"):
                continue
            if arguments.startswith("["):
                words = json.loads(arguments)
            else:
                words = shlex.split(arguments)
            if any(word.startswith("--from") for word in words):
                continue
            words = [word for word in words if not word.startswith("--")]
            yield words[:-1], words[-1]


def exec_form(arguments: str) -> list[str]:
    return json.loads(arguments) if arguments.startswith("[") else ["/bin/sh", "-c", arguments]


def effective(lineage: list[Stage], keyword: str) -> list[str] | None:
    """The CMD or ENTRYPOINT a stage ends up with (the last one along its lineage)."""
    values = [value for stage in lineage for value in stage.all(keyword)]
    return exec_form(values[-1]) if values else None


def exposed_ports(lineage: list[Stage]) -> set[int]:
    return {int(port.split("/")[0]) for stage in lineage for value in stage.all("EXPOSE") for port in value.split()}


# --- .dockerignore ------------------------------------------------------------------------------------


@functools.cache  # Read once: ignored_by_docker asks for every path of the build context.
def dockerignore_patterns() -> tuple[tuple[bool, str], ...]:
    patterns = []
    for line in (REPO_ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            patterns.append((negated, line.lstrip("!").strip("/")))
    return tuple(patterns)


def _pattern_matches(pattern: str, path: str) -> bool:
    """Docker's rule: a pattern matching a directory also matches everything under it."""
    parts = path.split("/")
    candidates = ["/".join(parts[: index + 1]) for index in range(len(parts))]
    if pattern.startswith("**/"):
        tails = ["/".join(parts[index:end]) for index in range(len(parts)) for end in range(index + 1, len(parts) + 1)]
        return any(fnmatch.fnmatchcase(tail, pattern[3:]) for tail in tails)
    return any(
        fnmatch.fnmatchcase(candidate, pattern) and candidate.count("/") == pattern.count("/")
        for candidate in candidates
    )


def ignored_by_docker(path: str) -> bool:
    """Whether a context-relative path stays out of the build context (the last matching pattern wins)."""
    ignored = False
    for negated, pattern in dockerignore_patterns():
        if _pattern_matches(pattern, path):
            ignored = not negated
    return ignored


# --- Things that read the names -----------------------------------------------------------------------


def prefect_setting_names() -> set[str]:
    from prefect.settings import Settings
    from prefect.settings.legacy import _get_valid_setting_names

    return _get_valid_setting_names(Settings)


def mlflow_server_options() -> dict[str, str]:
    """Environment variable -> option of `mlflow server` (click reads each option from its variable)."""
    import mlflow.cli

    return {param.envvar: param.opts[0] for param in mlflow.cli.server.params if param.envvar}


def mlflow_environment_variables() -> set[str]:
    """The environment variables MLflow itself reads (mlflow.environment_variables)."""
    import mlflow.environment_variables as variables

    return {value.name for value in vars(variables).values() if hasattr(value, "name") and hasattr(value, "get")}


def console_scripts() -> set[str]:
    return {entry.name for entry in importlib.metadata.entry_points(group="console_scripts")}


def repository_text(*patterns: str) -> str:
    return "\n".join(
        path.read_text(encoding="utf-8", errors="replace")
        for pattern in patterns
        for path in sorted(REPO_ROOT.glob(pattern))
        if path.is_file()
    )
