"""A file's SHA-256 (the library's `cifar.io.file_digest`), and the one recorded beside an archive."""

from __future__ import annotations

from pathlib import Path

from cifar.io import file_digest

__all__ = ["archive_sha256", "file_digest", "recorded_sha256"]


def recorded_sha256(archive: Path) -> str | None:
    """The digest in `<archive>.sha256` beside the archive (`sha256sum`'s format), or None without one."""
    archive = Path(archive)
    recorded = archive.with_name(archive.name + ".sha256")
    return recorded.read_text(encoding="utf-8").split()[0] if recorded.is_file() else None


def archive_sha256(archive: Path) -> str:
    """The archive's SHA-256: the recorded one when there is one (reading 170 MB takes a while), else computed."""
    return recorded_sha256(archive) or file_digest(archive)
