"""`make backup` / `make restore`'s manifest: a backup is trusted only whole and unchanged (scripts/backup/).

The container side (pg_dump, the volumes, the restore into an empty stack) is drilled by `make stack-check`.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from scripts.backup.__main__ import main
from scripts.backup.manifest import (
    BackupError,
    DatabaseDump,
    Manifest,
    VolumeArchive,
    compose_volumes,
    count_differences,
    kept_volumes,
    stored_file,
    tar_contents,
    verify,
    write_manifest,
)


def write_tar(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as archive:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))


@pytest.fixture
def backup(tmp_path: Path) -> Path:
    """A backup directory as `make backup` writes it: one dump, one volume's tar, the manifest."""
    (tmp_path / "mlflow.dump").write_bytes(b"PGDMP pretend custom-format archive")
    write_tar(tmp_path / "mlartifacts.tar", {"./1/models/m-1/MLmodel": b"flavors: {}\n", "./1/a.txt": b"abc"})
    files, size = tar_contents(tmp_path / "mlartifacts.tar")
    manifest = Manifest(
        created="2026-11-25T03:27:50+00:00",
        project="cifar",
        versions={"postgresql": "15.14"},
        databases=[DatabaseDump(name="mlflow", file="mlflow.dump", tables={"public.runs": 3})],
        volumes=[
            VolumeArchive(
                volume="mlartifacts",
                service="mlflow",
                path="/srv/mlartifacts",
                file="mlartifacts.tar",
                files=files,
                bytes=size,
            )
        ],  # fmt: skip
        files=[stored_file(tmp_path, "mlflow.dump"), stored_file(tmp_path, "mlartifacts.tar")],
    )
    write_manifest(tmp_path, manifest)
    return tmp_path


def test_a_whole_backup_verifies_and_its_tar_is_counted_without_extracting(backup: Path):
    manifest = verify(backup)
    assert [dump.name for dump in manifest.databases] == ["mlflow"]
    assert (manifest.volumes[0].files, manifest.volumes[0].bytes) == (2, len(b"flavors: {}\n") + 3)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda directory: (directory / "mlflow.dump").write_bytes(b"PGDMP pretend custom-format archivX"), "damaged"),
        (lambda directory: (directory / "mlflow.dump").write_bytes(b"PGDMP"), "incomplete or changed"),
        (lambda directory: (directory / "mlartifacts.tar").unlink(), "mlartifacts.tar is missing"),
        (lambda directory: (directory / "manifest.json").unlink(), "has no manifest.json"),
        (lambda directory: (directory / "manifest.json").write_text('{"format": 2}'), "is not a backup manifest"),
    ],
)
def test_a_damaged_or_incomplete_backup_is_refused_naming_the_file(backup: Path, damage, message):
    damage(backup)
    with pytest.raises(BackupError, match=message):
        verify(backup)


def test_the_kept_volumes_are_the_compose_files_named_volumes_but_the_databases():
    assert compose_volumes() == [("mlartifacts", "mlflow", "/srv/mlartifacts"), ("workdir", "worker", "/app/workdir")]
    compose = {
        "services": {
            "postgres": {"volumes": ["postgres:/var/lib/postgresql/data"]},
            "serve": {"profiles": ["serve"], "volumes": ["cache:/cache"]},
            "worker": {"volumes": ["workdir:/app/workdir", "./data:/data:ro"]},
            "worker-gpu": {"volumes": ["workdir:/app/workdir"]},
        },
        "volumes": {"postgres": None, "workdir": None, "cache": None},
    }
    assert kept_volumes(compose) == [("workdir", "worker", "/app/workdir")]


def test_row_counts_that_differ_are_named():
    assert count_differences("mlflow", {"public.runs": 3, "public.metrics": 9}, {"public.runs": 3}) == [
        "mlflow public.metrics: 9 backed up, 0 restored"
    ]


def test_restore_of_a_missing_directory_is_one_error_line(tmp_path: Path, capsys):
    env_file = tmp_path / ".env"
    env_file.write_text("POSTGRES_PASSWORD=secret\n")
    code = main(["--env-file", str(env_file), "restore", str(tmp_path / "nowhere")])
    error = capsys.readouterr().err
    assert code == 1
    assert error.startswith(f"error: no backup directory at {tmp_path / 'nowhere'}") and "secret" not in error
