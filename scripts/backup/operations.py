"""Back up a running compose project of docker/compose.yaml, and restore a backup into an empty one.

Databases: pg_dump (custom format) in the postgres container; each named volume (compose_volumes()): a tar
of its mount, read from the running service. Restore fills each before anything that uses it starts.
"""

from __future__ import annotations

import re
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from cifar.tracking import git_commit
from scripts.backup.manifest import (
    DATABASE_SERVICE,
    BackupError,
    DatabaseDump,
    Manifest,
    VolumeArchive,
    compose_volumes,
    count_differences,
    stored_file,
    tar_contents,
    utc_stamp,
    verify,
    write_manifest,
)
from scripts.stack_check.shell import StepError
from scripts.stack_check.stack import Stack
from scripts.stack_check.teardown import leftovers, remove_project

DUMP_IN_CONTAINER = "/tmp/cifar-backup.dump"
# Rows per user table, as schema.table<TAB>count lines (one query: psql -c takes no \gexec).
TABLE_COUNTS = (
    "SELECT table_schema || '.' || table_name, (xpath('/row/c/text()', query_to_xml(format("
    "'SELECT count(*) AS c FROM %I.%I', table_schema, table_name), false, true, '')))[1]::text "
    "FROM information_schema.tables WHERE table_type = 'BASE TABLE' "
    "AND table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1"
)
# One transaction exports its snapshot, pg_dump dumps that snapshot, and the rows are counted in it: the
# counts are the dump's even while the stack keeps writing (Prefect's events, logs, heartbeats).
DUMP_SCRIPT = f"""\\set ON_ERROR_STOP 1
BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;
SELECT pg_export_snapshot() AS snapshot \\gset
\\setenv CIFAR_SNAPSHOT :snapshot
\\! pg_dump --format=custom --snapshot="$CIFAR_SNAPSHOT" --file={DUMP_IN_CONTAINER} "$PGDATABASE"
{TABLE_COUNTS};
COMMIT;
"""
DATABASE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def postgres_user(stack: Stack) -> str:
    return stack.variables.get("POSTGRES_USER") or "cifar"


def require_running(stack: Stack, services: list[str]) -> None:
    for service in services:
        names = stack.containers(service)
        if not names or stack.state(names[0]) != "running":
            raise BackupError(
                f"service {service} of compose project {stack.project} is not running: start the stack "
                "(docker/compose.yaml) and run the backup again"
            )


def run_to_file(stack: Stack, argv: list[str], path: Path, ok: tuple[int, ...] = (0,)) -> None:
    """`engine argv`, its standard output (binary) into `path`; logged like every other command. Exit
    statuses in `ok` are success."""
    command = [stack.engine.name, *argv]
    stack.engine.shell.write(f"\n$ {' '.join(command)} > {path}\n")
    with open(path, "wb") as output:
        result = subprocess.run(command, env=stack.engine.env, stdout=output, stderr=subprocess.PIPE, timeout=3600)
    stack.engine.shell.write(f"{result.stderr.decode(errors='replace')}[exit {result.returncode}]\n")
    if result.returncode not in ok:
        raise StepError(f"`{' '.join(command[:4])} ...` exited {result.returncode}: {result.stderr[-300:]!r}")


def run_from_file(stack: Stack, argv: list[str], path: Path) -> None:
    """`engine argv` with `path` as its standard input."""
    command = [stack.engine.name, *argv]
    stack.engine.shell.write(f"\n$ {' '.join(command)} < {path}\n")
    with open(path, "rb") as source:
        result = subprocess.run(command, env=stack.engine.env, stdin=source, capture_output=True, timeout=3600)
    stack.engine.shell.write(f"{(result.stdout + result.stderr).decode(errors='replace')}[exit {result.returncode}]\n")
    if result.returncode != 0:
        raise StepError(f"`{' '.join(command[:4])} ...` exited {result.returncode}: {result.stderr[-300:]!r}")


def table_counts(lines: list[list[str]]) -> dict[str, int]:
    return {line[0]: int(line[1]) for line in lines if len(line) == 2}


def stack_versions(stack: Stack) -> dict[str, str]:
    versions = {"postgresql": stack.psql("postgres", "SHOW server_version")[0][0]}
    versions["pg_dump"] = stack.exec(DATABASE_SERVICE, "pg_dump", "--version", timeout=60).stdout.strip()
    script = "from importlib.metadata import version; print(version('prefect'), version('mlflow'))"
    prefect, mlflow = stack.exec("prefect-server", "python", "-c", script, timeout=120).stdout.split()
    versions |= {"prefect": prefect, "mlflow": mlflow, "code": git_commit() or "unknown"}
    for container in stack.containers():
        image = stack.engine("inspect", "--format", "{{.Image}}", container, timeout=60).stdout.strip()
        service = container.removeprefix(f"{stack.project}_").removeprefix(f"{stack.project}-")
        versions[f"image {service}"] = image[:19]
    return versions


def dump_database(stack: Stack, database: str, directory: Path) -> DatabaseDump:
    container, file = stack.container(DATABASE_SERVICE), f"{database}.dump"
    environment = ["-e", f"PGUSER={postgres_user(stack)}", "-e", f"PGDATABASE={database}"]
    counted = stack.engine("exec", "-i", *environment, container, "psql", "-X", "-tAqF", "\t", input=DUMP_SCRIPT)
    # \! does not stop psql when pg_dump fails: read the archive's table of contents to know it is whole.
    stack.exec(DATABASE_SERVICE, "pg_restore", "--list", DUMP_IN_CONTAINER, timeout=300)
    run_to_file(stack, ["exec", container, "cat", DUMP_IN_CONTAINER], directory / file)
    stack.exec(DATABASE_SERVICE, "rm", "-f", DUMP_IN_CONTAINER, timeout=60)
    lines = [line.split("\t") for line in counted.stdout.splitlines() if "\t" in line]
    return DatabaseDump(name=database, file=file, tables=table_counts(lines))


def archive_volume(stack: Stack, volume: str, service: str, path: str, directory: Path) -> VolumeArchive:
    file, tar = f"{volume}.tar", ["tar", "-c", "-f", "-", "--warning=no-file-changed", "-C", path, "."]
    # GNU tar exits 1 when a file changed while it was read (a training writing its checkpoint): the archive
    # holds it as it was then, and a restore checks the volume against the archive, not against the live files.
    run_to_file(stack, ["exec", stack.container(service), *tar], directory / file, ok=(0, 1))
    files, size = tar_contents(directory / file)
    return VolumeArchive(volume=volume, service=service, path=path, file=file, files=files, bytes=size)


def back_up(stack: Stack, root: Path) -> tuple[Path, Manifest]:
    """A new directory under `root` (named by the UTC time) holding every database and kept volume, and the
    manifest, written last: a directory without one is an unfinished backup."""
    started = time.monotonic()
    volumes = compose_volumes()
    require_running(stack, [DATABASE_SERVICE, "prefect-server", *sorted({service for _, service, _ in volumes})])
    directory = Path(root) / utc_stamp()
    directory.mkdir(parents=True, exist_ok=False)
    directory.chmod(0o700)  # It holds the CA's private key and MLflow's password hashes (docs/PRODUCTION.md).
    query = "SELECT datname FROM pg_database WHERE NOT datistemplate AND datname <> 'postgres' ORDER BY 1"
    databases = [row[0] for row in stack.psql("postgres", query)]
    # Databases first: a run finished between the two steps leaves files no row points to, never the reverse.
    dumps = [dump_database(stack, database, directory) for database in databases]
    archives = [archive_volume(stack, volume, service, path, directory) for volume, service, path in volumes]
    names = [item.file for item in (*dumps, *archives)]
    manifest = Manifest(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        project=stack.project,
        versions=stack_versions(stack),
        databases=dumps,
        volumes=archives,
        files=[stored_file(directory, name) for name in names],
        seconds=round(time.monotonic() - started, 1),
    )
    write_manifest(directory, manifest)
    return directory, manifest


def require_empty(stack: Stack, force: bool) -> None:
    """No container or volume of the project, or (`force`) all of them removed first."""
    left = {kind: names for kind, names in leftovers(stack.engine, stack.project).items() if kind != "networks"}
    if not left:
        return
    if not force:
        found = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in left.items())
        raise BackupError(
            f"compose project {stack.project} is not empty ({found}): a restore replaces everything in it; "
            "add --force (make restore FORCE=1) to delete it first"
        )
    remove_project(stack.engine, stack, stack.project)


def restore_database(stack: Stack, dump: DatabaseDump, directory: Path) -> None:
    if not DATABASE_NAME.fullmatch(dump.name):
        raise BackupError(f"database name {dump.name!r} in the manifest is not a plain identifier")
    stack.psql("postgres", f'DROP DATABASE IF EXISTS "{dump.name}" WITH (FORCE)')
    stack.psql("postgres", f'CREATE DATABASE "{dump.name}"')
    container, user = stack.container(DATABASE_SERVICE), postgres_user(stack)
    restore = ["pg_restore", "-U", user, "-d", dump.name, "--no-owner", "--no-privileges", "--exit-on-error"]
    run_from_file(stack, ["exec", "-i", container, *restore], directory / dump.file)
    differences = count_differences(f"{dump.name}:", dump.tables, table_counts(stack.psql(dump.name, TABLE_COUNTS)))
    if differences:
        raise StepError(f"database {dump.name} restored with other row counts: {'; '.join(differences[:5])}")


def restore_volume(stack: Stack, archive: VolumeArchive, directory: Path) -> None:
    """The archive unpacked into the volume through a throwaway container of the service's image, as its user,
    before the service starts (`up --no-start` made its container and volume)."""
    stack.compose("up", "--no-start", "--no-deps", archive.service)
    container = stack.container(archive.service)
    image = stack.engine("inspect", "--format", "{{.Image}}", container, timeout=60).stdout.strip()
    helper = ["run", "--rm", "--network", "none", "--volumes-from", container]
    untar = [*helper, "-i", "--entrypoint", "tar", image, "-x", "-f", "-", "-C", archive.path]
    run_from_file(stack, untar, directory / archive.file)
    sizes = stack.engine(*helper, "--entrypoint", "find", image, archive.path, "-type", "f", "-printf", r"%s\n")
    found = [int(size) for size in sizes.stdout.split()]
    if (len(found), sum(found)) != (archive.files, archive.bytes):
        raise StepError(
            f"volume {archive.volume}: {len(found)} files, {sum(found)} bytes after the restore; "
            f"the backup holds {archive.files} files, {archive.bytes} bytes"
        )


def restore(stack: Stack, directory: Path, force: bool = False) -> tuple[Manifest, float]:
    """The backup in `directory` (verified first) into the empty project, then every service started; the
    manifest and the seconds it took."""
    manifest = verify(directory)
    started = time.monotonic()
    require_empty(stack, force)
    stack.compose("up", "-d", DATABASE_SERVICE)
    stack.wait_healthy([DATABASE_SERVICE], 180)
    backed_up, running = manifest.versions.get("postgresql", "0"), stack.psql("postgres", "SHOW server_version")[0][0]
    if int(running.split(".")[0]) < int(backed_up.split(".")[0]):
        raise BackupError(f"the backup is of PostgreSQL {backed_up}; this stack runs {running}, an older major")
    for dump in manifest.databases:
        restore_database(stack, dump, Path(directory))
    for archive in manifest.volumes:
        restore_volume(stack, archive, Path(directory))
    stack.up()
    return manifest, time.monotonic() - started


def unfinished_flow_runs(stack: Stack) -> list[str]:
    """Flow runs the backup caught in progress: restored RUNNING (or PENDING) with no process behind them, and
    the heartbeat automation's window long over, so nothing will end them by itself."""
    database = stack.variables.get("CIFAR_PREFECT_DB") or "prefect"
    query = "SELECT name, id, state_type FROM flow_run WHERE state_type IN ('PENDING', 'RUNNING', 'CANCELLING')"
    return [f"{name} ({flow_run_id}, {state})" for name, flow_run_id, state in stack.psql(database, query)]
