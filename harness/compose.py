"""docker/compose.yaml's variables: `.env` files and `${VAR}` interpolation as the compose specification has it.

variables = read_env_file(ENV_EXAMPLE_PATH)
services = interpolate_tree(yaml.safe_load(COMPOSE_FILE.read_text()), variables)["services"]
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any

from harness import REPO_ROOT

DOCKER_DIR = REPO_ROOT / "docker"
COMPOSE_FILE = DOCKER_DIR / "compose.yaml"
ENV_EXAMPLE_PATH = DOCKER_DIR / "env.example"

# The stack's secrets (docker/.env): generated where missing or empty (scripts/stack_env.py, the stack check).
# The value's prefix: Prefect's auth string is "user:password".
SECRET_VARIABLES = {
    "POSTGRES_PASSWORD": "",
    "PREFECT_AUTH_STRING": "cifar:",
    "MLFLOW_ADMIN_PASSWORD": "",
    "MLFLOW_WORKER_PASSWORD": "",
    "MLFLOW_VIEWER_PASSWORD": "",
    "MLFLOW_SECRET_KEY": "",
    "SERVE_PASSWORD": "",
}

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


def generate_secrets(variables: dict[str, str]) -> dict[str, str]:
    """A new random value for each of SECRET_VARIABLES that `variables` lacks or leaves empty (32 URL-safe
    characters: MLflow wants 12 or more; nothing in a URL, an INI file or an env file needs quoting)."""
    return {
        name: prefix + secrets.token_urlsafe(24) for name, prefix in SECRET_VARIABLES.items() if not variables.get(name)
    }


def fill_env_file(path: Path, template: Path = ENV_EXAMPLE_PATH) -> dict[str, str]:
    """`path` (made from `template` when missing) with every secret it lacks generated and written in place,
    comments and order kept; the generated values, to be shown once."""
    path = Path(path)
    lines = (path if path.is_file() else Path(template)).read_text(encoding="utf-8").splitlines()
    generated = generate_secrets(read_env_file(path) if path.is_file() else {})
    missing = dict(generated)
    for index, line in enumerate(lines):
        key = line.partition("=")[0].strip()
        if key in missing and not line.lstrip().startswith("#"):
            lines[index] = f"{key}={missing.pop(key)}"
    lines += [f"{key}={value}" for key, value in missing.items()]
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return generated


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
