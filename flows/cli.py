"""The command line of the `cifar` flow: `python flows/pipeline.py [options]` (see `--help`).

Flags and `--set` become one validated config, and the request is checked against this machine,
before anything starts: a bad value or an impossible request exits 2 with one `error:` line. The run
itself happens in a child process this one supervises: however the child ends (an error, Ctrl-C, the
OOM killer), none of its processes outlive it, the ephemeral Prefect server included. Tracebacks go
to `WORKDIR/logs/`; the terminal gets one line per log record and, on failure, one `error:` line.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import logging
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cifar import locks
from cifar.config import PRESETS, STAGES, ConfigOverrides, PipelineConfig, make_config, resolve_workdir
from cifar.preflight import ImpossibleRequestError, check_request
from flows.pipeline import REPO_ROOT, cifar_pipeline
from tasks.artifacts import format_summary

SUPERVISED_ENV = "CIFAR_PIPELINE_SUPERVISED"  # Set in the child: it runs the flow instead of supervising.
PR_SET_CHILD_SUBREAPER = 36  # prctl option (Linux): orphaned descendants are re-parented to this process.


class ConfigError(ValueError):
    """The command line does not describe a valid configuration."""


def parse_value(text: str) -> Any:
    """A --set value: JSON when it parses (numbers, true/false, null, lists), else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_overrides(assignments: Sequence[str]) -> dict[str, Any]:
    """`["train.epochs=3", "seed=1"]` -> `{"train": {"epochs": 3}, "seed": 1}`."""
    overrides: dict[str, Any] = {}
    for assignment in assignments:
        key, separator, text = assignment.partition("=")
        path = key.strip().split(".")
        if not separator or not all(path):
            raise ConfigError(f"--set expects section.field=value, got {assignment!r}")
        target = overrides
        for part in path[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"--set {assignment!r} conflicts with an earlier --set of {part!r}")
        target[path[-1]] = parse_value(text)
    return overrides


def describe_validation_error(error: ValidationError) -> str:
    """One line per invalid field: `train.epochs: Input should be greater than or equal to 1 (got 0)`."""
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "config"
        message = item["msg"].removeprefix("Value error, ")
        shown = (
            "" if item["type"] == "missing" or repr(item.get("input")) in message else f" (got {item.get('input')!r})"
        )
        lines.append(f"{field}: {message}{shown}")
    return "invalid configuration: " + "; ".join(lines)


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


def add_archive_arguments(parser: argparse.ArgumentParser) -> None:
    """--source, --sha256 and --md5: where the archive is and what it must hash to (every entry point)."""
    add = parser.add_argument
    add("--source", help="http(s)/file:// URL or local path of the archive (default: the official one)")
    add("--sha256", help="expected SHA-256 of the archive (hex)")
    add("--md5", help="expected MD5 of the archive (hex); official URLs default to the published one")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python flows/pipeline.py",
        description="CIFAR-10 from the raw archive to a served model (Prefect flow `cifar`).",
        epilog="Example: python flows/pipeline.py --source cifar-10-python.tar.gz --preset smoke "
        "--set train.epochs=3 --until evaluate",
    )
    add = parser.add_argument
    add_archive_arguments(parser)
    add("--workdir", default="./workdir", help="where data, runs, exports and summary.json go")
    add("--preset", default="default", choices=sorted(PRESETS), help="named set of settings")
    add("--until", default="export", choices=STAGES, help="last stage to run (export includes registering)")
    add("--refresh", action="store_true", help="recompute every stage, even where finished work exists")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="continue the training run (the default)")
    resume.add_argument("--fresh", action="store_true", help="discard the run's checkpoints (train.resume=false)")
    help_set = "override one config field, e.g. --set train.epochs=3 (repeatable; values parse as JSON)"
    add("--set", action="append", metavar="SECTION.FIELD=VALUE", help=help_set)
    return parser


class FirstLineFormatter(logging.Formatter):
    """Formats a record as `formatter` does, without its traceback: the terminal gets one line per record."""

    def __init__(self, formatter: logging.Formatter | None) -> None:
        super().__init__()
        self.formatter = formatter or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.formatter.format(record).split("\n", 1)[0]
        finally:
            record.exc_info, record.exc_text = saved


def log_to_file(workdir: Path, name: str = "pipeline") -> Path:
    """Every record, tracebacks included, goes to WORKDIR/logs/<name>-<UTC time>-<pid>.log; the terminal
    keeps one line of each."""
    path = workdir / "logs" / f"{name}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{os.getpid()}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for handler in root.handlers:
        if type(handler) is not logging.FileHandler and isinstance(handler, logging.StreamHandler):
            handler.setFormatter(FirstLineFormatter(handler.formatter))
    root.addHandler(file_handler)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        check_request(config)
        workdir = resolve_workdir(args.workdir)
    except (ValueError, ImpossibleRequestError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2  # Before any work: nothing was started or written.
    if os.environ.get(SUPERVISED_ENV) != "1" and sys.platform == "linux":
        prepare_ephemeral_database()
        return supervise(sys.argv[1:] if argv is None else list(argv))
    log_path = log_to_file(workdir)
    try:
        summary = cifar_pipeline(
            config=ConfigOverrides.of(config), workdir=args.workdir, until=args.until, refresh=args.refresh
        )
    except Exception as error:
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(traceback.format_exc())
        print(f"error: {type(error).__name__}: {error} (full log: {log_path})", file=sys.stderr)
        return 1
    print(format_summary(summary))
    return 0


def prepare_ephemeral_database() -> None:
    """Migrates Prefect's own SQLite database and registers its block types, under a lock, when no server is configured.

    Without a server every run starts a temporary one, which migrates the database under PREFECT_HOME
    and registers Prefect's block types when they are new to it (a fresh machine, an upgraded Prefect);
    runs started at once would do it together and collide (flows/prefect_database.py). Done here once
    per installed Prefect, recorded beside the database.
    """
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:
        return
    url = get_current_settings().server.database.connection_url.get_secret_value()
    if not url.startswith("sqlite+aiosqlite:///"):
        return
    database = Path(url.removeprefix("sqlite+aiosqlite:///"))
    prepared_for, versions = database.with_name(f".{database.name}.prepared"), prefect_versions()
    with locks.exclusive(database.with_name(f".{database.name}.lock"), f"Prefect's database {database}"):
        if database.exists() and prepared_for.exists() and prepared_for.read_text(encoding="utf-8") == versions:
            return
        command = [sys.executable, str(REPO_ROOT / "flows" / "prefect_database.py")]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"could not prepare Prefect's database {database}:\n{result.stderr[-3000:]}")
        prepared_for.write_text(versions, encoding="utf-8")  # Under the lock: nobody reads it half-written.


def prefect_versions() -> str:
    """The installed Prefect distributions (`prefect==3.8.8`, any collection): its migrations and block types."""
    names = {distribution.metadata["Name"] or "" for distribution in importlib.metadata.distributions()}
    prefects = sorted(name for name in names if name.lower().startswith("prefect"))
    return "".join(f"{name}=={importlib.metadata.version(name)}\n" for name in prefects)


def supervise(argv: list[str], script: str = "pipeline.py") -> int:
    """Runs `flows/<script>` in a child process; afterwards no process it started is left running."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # Its orphans (the Prefect server) become ours to end.
    command = [sys.executable, str(REPO_ROOT / "flows" / script), *argv]
    child = subprocess.Popen(command, env={**os.environ, SUPERVISED_ENV: "1"})  # Same process group: Ctrl-C reaches it.
    try:
        code = child.wait()
    except KeyboardInterrupt:
        code = child.wait()
    finally:
        import psutil

        leftovers = psutil.Process().children(recursive=True)
        for process in leftovers:
            process.kill()
        psutil.wait_procs(leftovers, timeout=10)
    if code < 0:
        name = signal.Signals(-code).name
        print(
            f"error: the pipeline process was killed by {name} (out of memory, or stopped by hand); "
            "run the same command again to resume",
            file=sys.stderr,
        )
        return 1
    return code
