"""python -m scripts.backup backup [--out DIR] | restore DIR [--force]: a compose project of docker/compose.yaml."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from harness.compose import DOCKER_DIR, ENV_EXAMPLE_PATH, read_env_file
from scripts.backup.manifest import BackupError
from scripts.backup.operations import back_up, restore, unfinished_flow_runs
from scripts.stack_check.engine import Engine
from scripts.stack_check.shell import Shell, StepError
from scripts.stack_check.stack import Stack


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.backup", description=__doc__)
    parser.add_argument("--project", default="cifar", help="compose project name (docker/compose.yaml: cifar)")
    parser.add_argument("--env-file", type=Path, default=DOCKER_DIR / ".env", help="the stack's variables")
    parser.add_argument("--engine", default=os.environ.get("ENGINE", "podman"), choices=("podman", "docker"))
    commands = parser.add_subparsers(dest="command", required=True)
    backup = commands.add_parser("backup", help="write a new timestamped backup directory")
    backup.add_argument("--out", type=Path, default=Path("backups"), help="where the directory is made")
    restoring = commands.add_parser("restore", help="restore a backup into an empty compose project")
    restoring.add_argument("directory", type=Path, help="a directory made by `backup`")
    restoring.add_argument("--force", action="store_true", help="delete the project's containers and volumes first")
    return parser.parse_args(argv)


def open_stack(arguments: argparse.Namespace, log: Path) -> Stack:
    if not arguments.env_file.is_file():
        raise BackupError(f"no {arguments.env_file}: the stack's variables (POSTGRES_PASSWORD; docker/env.example)")
    # The stack's own values over env.example's defaults, as compose reads them.
    variables = read_env_file(ENV_EXAMPLE_PATH) | read_env_file(arguments.env_file)
    shell = Shell(log)
    if variables.get("POSTGRES_PASSWORD"):
        shell.hide(variables["POSTGRES_PASSWORD"])
    return Stack(Engine(shell, arguments.engine), arguments.project, arguments.env_file, variables)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    log = Path(tempfile.mkstemp(prefix=f"cifar-{arguments.command}-", suffix=".log")[1])
    try:
        stack = open_stack(arguments, log)
        if arguments.command == "backup":
            directory, manifest = back_up(stack, arguments.out)
            total = sum(stored.bytes for stored in manifest.files)
            print(f"backup {directory}: {len(manifest.files)} files, {total / 1e6:.1f} MB in {manifest.seconds:.0f} s")
            for stored in manifest.files:
                print(f"  {stored.name:<18} {stored.bytes / 1e6:9.1f} MB  sha256 {stored.sha256[:16]}...")
        else:
            manifest, seconds = restore(stack, arguments.directory, force=arguments.force)
            print(f"restored {arguments.directory} (made {manifest.created}) into {stack.project} in {seconds:.0f} s:")
            print(f"  databases {', '.join(d.name for d in manifest.databases)}: every table's rows as backed up")
            print(f"  volumes {', '.join(v.volume for v in manifest.volumes)}: every file back; services healthy")
            for flow_run in unfinished_flow_runs(stack):
                print(
                    f"  in progress when backed up, now without a process: {flow_run}; mark it Crashed in the "
                    "Prefect UI (Change state) and run it again to resume from its last checkpoint"
                )
    except (BackupError, StepError) as error:
        print(f"error: {error} (commands: {log})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
