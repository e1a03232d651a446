"""A backup directory's manifest.json: what it holds, each file's size and SHA-256, and the stack it came from.

Written last by `make backup`; `make restore` verifies every file against it before touching the stack.
"""

from __future__ import annotations

import hashlib
import tarfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from harness.compose import COMPOSE_FILE

MANIFEST_NAME = "manifest.json"
DATABASE_SERVICE = "postgres"  # Its volume is kept as pg_dump archives, not as files.


class BackupError(ValueError):
    """A backup or a restore that cannot go ahead; its message names what to do."""


class StoredFile(BaseModel):
    name: str  # Relative to the backup directory.
    bytes: int
    sha256: str


class DatabaseDump(BaseModel):
    name: str
    file: str  # pg_dump's custom format.
    tables: dict[str, int]  # Rows per table (schema.table) when dumped; compared after pg_restore.


class VolumeArchive(BaseModel):
    volume: str  # As named in docker/compose.yaml.
    service: str  # The service that mounts it, and where.
    path: str
    file: str  # A tar of the mount's contents.
    files: int  # Regular files in it, and their bytes: compared with the volume after the restore.
    bytes: int


class Manifest(BaseModel):
    format: Literal[1] = 1
    created: str  # UTC, ISO 8601.
    project: str
    versions: dict[str, str]  # PostgreSQL, pg_dump, Prefect, MLflow, the images, the code's commit.
    databases: list[DatabaseDump]
    volumes: list[VolumeArchive]
    files: list[StoredFile]
    seconds: float = 0.0


def utc_stamp(now: datetime | None = None) -> str:
    """20261125T032750Z: a directory name that sorts by time."""
    return (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stored_file(directory: Path, name: str) -> StoredFile:
    path = directory / name
    return StoredFile(name=name, bytes=path.stat().st_size, sha256=sha256_file(path))


def tar_contents(path: Path) -> tuple[int, int]:
    """(regular files, their bytes) in a tar archive: its headers are read, nothing is extracted."""
    files = size = 0
    with tarfile.open(path, mode="r|") as archive:
        for member in archive:
            if member.isfile():
                files, size = files + 1, size + member.size
    return files, size


def kept_volumes(compose: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(volume, service, mount path) of each named volume of a loaded compose file whose files a backup keeps:
    all but the database's, mounted by the first service outside a profile (one that always runs)."""
    kept = {}
    for service_name, service in compose["services"].items():
        if service_name == DATABASE_SERVICE or service.get("profiles"):
            continue
        for mount in service.get("volumes", []):
            source, _, target = str(mount).partition(":")
            if source in (compose.get("volumes") or {}) and source not in kept:
                kept[source] = (source, service_name, target.split(":")[0])
    return list(kept.values())


def compose_volumes() -> list[tuple[str, str, str]]:
    import yaml

    return kept_volumes(yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8")))


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    path = directory / MANIFEST_NAME
    path.write_text(manifest.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return path


def verify(directory: Path) -> Manifest:
    """The manifest of the backup in `directory`, once every file it lists has its recorded size and SHA-256."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BackupError(f"no backup directory at {directory}")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise BackupError(f"{directory} has no {MANIFEST_NAME}: not a backup made by `make backup`, or unfinished")
    try:
        manifest = Manifest.model_validate_json(path.read_text(encoding="utf-8"))
    except ValidationError as error:
        raise BackupError(f"{path} is not a backup manifest: {error.errors()[0]['msg']}") from None
    listed = {stored.name for stored in manifest.files}
    needed = {dump.file for dump in manifest.databases} | {volume.file for volume in manifest.volumes}
    if needed - listed:
        raise BackupError(f"{path} lists no size or checksum for {', '.join(sorted(needed - listed))}")
    for stored in manifest.files:
        file = directory / stored.name
        if not file.is_file():
            raise BackupError(f"{file} is missing (the manifest lists it)")
        size = file.stat().st_size
        if size != stored.bytes:
            raise BackupError(f"{file} has {size} bytes, the manifest says {stored.bytes}: incomplete or changed")
        digest = sha256_file(file)
        if digest != stored.sha256:
            raise BackupError(f"{file}: SHA-256 {digest[:16]}..., the manifest says {stored.sha256[:16]}...: damaged")
    return manifest


def count_differences(what: str, expected: dict[str, int], found: dict[str, int]) -> list[str]:
    """Where `found` differs from `expected`, one line each: 'mlflow.public.runs: 5 rows, 4 restored'."""
    return [
        f"{what} {key}: {expected.get(key, 0)} backed up, {found.get(key, 0)} restored"
        for key in sorted(expected.keys() | found.keys())
        if expected.get(key, 0) != found.get(key, 0)
    ]
