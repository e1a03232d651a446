"""Command-line arguments every flow shares: `--set` and the archive flags become one validated config.

A bad value raises ConfigError (a ValueError) naming the field; flows.runtime.main turns it into one
`error:` line and exit code 2, before any work.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from cifar.config import PRESETS, ConfigOverrides, PipelineConfig, make_config
from cifar.text import SHOWN_CHARACTERS, brief, printable, shortened


class ConfigError(ValueError):
    """The command line does not describe a valid configuration."""


def parse_value(text: str) -> Any:
    """A --set value: JSON when it parses (numbers, true/false, null, lists), else the plain string."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # Nested too deep to parse is not JSON either.
        return text


def parse_overrides(assignments: Sequence[str]) -> dict[str, Any]:
    """`["train.epochs=3", "seed=1"]` -> `{"train": {"epochs": 3}, "seed": 1}`."""
    overrides: dict[str, Any] = {}
    for assignment in assignments:
        key, separator, text = assignment.partition("=")
        path = key.strip().split(".")
        if not separator or not all(path):
            raise ConfigError(f"--set expects section.field=value, got {shortened(repr(assignment))}")
        target = overrides
        for part in path[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(
                    f"--set {shortened(repr(assignment))} conflicts with an earlier --set of {shortened(repr(part))}"
                )
        target[path[-1]] = parse_value(text)
    return overrides


MAX_LISTED_ERRORS = 5  # Fields named in the one line; a union's every branch is an error of its own.


def describe_validation_error(error: ValidationError) -> str:
    """One line naming the invalid fields: `train.epochs: Input should be greater than or equal to 1 (got 0)`."""
    items, lines = error.errors(), []
    for item in items[:MAX_LISTED_ERRORS]:
        field = printable(shortened(".".join(str(part) for part in item["loc"]))) or "config"
        message = shortened(item["msg"].removeprefix("Value error, "), 2 * SHOWN_CHARACTERS)  # Some echo the value.
        given = brief(item.get("input"))
        shown = "" if item["type"] == "missing" or given in message else f" (got {printable(given)})"
        lines.append(f"{field}: {message}{shown}")
    more = f"; and {len(items) - MAX_LISTED_ERRORS} more" if len(items) > MAX_LISTED_ERRORS else ""
    return "invalid configuration: " + "; ".join(lines) + more


def _assignments(args: argparse.Namespace) -> dict[str, Any]:
    """`--set` and, where the command has them, --source/--sha256/--md5, as nested override values."""
    overrides = parse_overrides(args.set or [])
    given = {field: getattr(args, field, None) for field in ("source", "sha256", "md5")}
    archive = {field: value for field, value in given.items() if value is not None}
    if archive:
        data = overrides.setdefault("data", {})
        if not isinstance(data, dict):
            raise ConfigError("--set data=... must name a field: data.source=..., data.sha256=...")
        data.update(archive)
    return overrides


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    """The validated config of a command line; raises ConfigError naming the bad field."""
    overrides = _assignments(args)
    if args.fresh:
        overrides.setdefault("train", {})["resume"] = False
    try:
        return make_config(args.preset, overrides)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None


def overrides_from_args(args: argparse.Namespace) -> ConfigOverrides:
    """The validated overrides of a command whose flow takes them (ingest, predict); ConfigError names the field."""
    try:
        overrides = ConfigOverrides.model_validate(_assignments(args))
        overrides.resolve()
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None
    return overrides


def flow_parser(script: str, description: str, example: str | None = None) -> argparse.ArgumentParser:
    """The parser of `python flows/<script>.py`; `example` holds the arguments of the example in its epilog."""
    epilog = f"Example: python flows/{script}.py {example}" if example else None
    return argparse.ArgumentParser(prog=f"python flows/{script}.py", description=description, epilog=epilog)


def add_set_argument(parser: argparse.ArgumentParser, example: str, what: str = "one config field") -> None:
    """--set SECTION.FIELD=VALUE, repeatable: a config field over the preset's (values parse as JSON)."""
    help_set = f"override {what}, e.g. --set {example} (repeatable; values parse as JSON)"
    parser.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help=help_set)


def add_run_arguments(
    parser: argparse.ArgumentParser, *, preset: str, workdir: str, preset_help: str = "named set of settings"
) -> None:
    """What a training command starts from: the archive, the workdir (`workdir`: what goes there), the preset."""
    add_archive_arguments(parser)
    parser.add_argument("--workdir", default="./workdir", help=workdir)
    parser.add_argument("--preset", default=preset, choices=sorted(PRESETS), help=preset_help)


def add_archive_arguments(parser: argparse.ArgumentParser) -> None:
    """--source, --sha256 and --md5: where the archive is and what it must hash to (every entry point)."""
    add = parser.add_argument
    add("--source", help="http(s)/file:// URL or local path of the archive (default: the official one)")
    add("--sha256", help="expected SHA-256 of the archive (hex)")
    add("--md5", help="expected MD5 of the archive (hex); official URLs default to the published one")
