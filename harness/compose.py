"""docker/compose.yaml's variables: `.env` files and `${VAR}` interpolation as the compose specification has it.

variables = read_env_file(ENV_EXAMPLE_PATH)
services = interpolate_tree(yaml.safe_load(COMPOSE_FILE.read_text()), variables)["services"]
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from harness import REPO_ROOT

DOCKER_DIR = REPO_ROOT / "docker"
COMPOSE_FILE = DOCKER_DIR / "compose.yaml"
ENV_EXAMPLE_PATH = DOCKER_DIR / "env.example"

# `$$` (a literal $), `${NAME}` with an optional `:-`, `-`, `:?` or `?` and its argument, or a bare `$NAME`.
_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a docker/.env-style file (comments and blank lines ignored)."""
    values = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def write_env_file(path: Path, variables: dict[str, str]) -> None:
    """`variables` as KEY=VALUE lines in a file only its owner can read (it may hold a password)."""
    path = Path(path)
    path.touch(mode=0o600)
    path.write_text("".join(f"{key}={value}\n" for key, value in variables.items()), encoding="utf-8")


def interpolate(text: str, variables: dict[str, str]) -> str:
    """Compose's interpolation: `${VAR}`, `$VAR`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`,
    `${VAR?error}`, `$$`. With a colon an empty value counts as missing; without, only an unset one.
    ValueError for a required variable that is missing."""

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        operator, argument = match.group(2), match.group(3)
        value = variables.get(name)
        if operator in (":-", ":?"):
            missing = not value
        else:
            missing = value is None
        if missing and operator in (":-", "-"):
            return interpolate(argument, variables)
        if missing and operator in (":?", "?"):
            raise ValueError(f"required variable {name} is missing: {argument}")
        return value or ""

    return _VARIABLE.sub(substitute, text)


def interpolate_tree(value: Any, variables: dict[str, str]) -> Any:
    """Every string in a loaded YAML tree interpolated."""
    if isinstance(value, str):
        return interpolate(value, variables)
    if isinstance(value, list):
        return [interpolate_tree(item, variables) for item in value]
    if isinstance(value, dict):
        return {key: interpolate_tree(item, variables) for key, item in value.items()}
    return value


def variables_used(text: str) -> dict[str, str | None]:
    """Interpolated variable name -> operator (`:?`, `:-`, ... or None) as written in `text`."""
    used = {}
    for match in _VARIABLE.finditer(text):
        if match.group(0) != "$$":
            name = match.group(1) or match.group(4)
            operator = match.group(2)
            if used.get(name) != ":?":  # Remember the strictest use.
                used[name] = operator
    return used
