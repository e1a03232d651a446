"""Small file-system helpers shared by every stage: atomic writes and hashing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHUNK_BYTES = 1 << 20  # Read files in 1 MiB chunks when hashing.
HEX_LENGTHS = {"sha256": 64, "md5": 32}  # Hex characters of each digest the pipeline checks.


CACHE_DIR_ENV = "CIFAR_CACHE_DIR"  # What this machine remembers between runs; default ~/.cache/cifar.


def cache_directory() -> Path:
    """$CIFAR_CACHE_DIR, else $XDG_CACHE_HOME/cifar or ~/.cache/cifar (not created here)."""
    directory = os.environ.get(CACHE_DIR_ENV)
    if not directory:
        directory = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cifar"
    return Path(directory)


def normalise_digest(algorithm: str, digest: str | None) -> str | None:
    """The lower-cased hex digest (None stays None), or a ValueError naming what is wrong with it."""
    if digest is None:
        return None
    value = digest.strip().lower()
    length = HEX_LENGTHS[algorithm]
    if len(value) != length or any(character not in "0123456789abcdef" for character in value):
        raise ValueError(f"{algorithm} must be {length} hex characters, got {digest!r}")
    return value


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file, read in chunks."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(path: str | Path) -> dict[str, str]:
    """SHA-256 and MD5 of a file in one pass."""
    sha256, md5 = hashlib.sha256(), hashlib.md5()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            sha256.update(chunk)
            md5.update(chunk)
    return {"sha256": sha256.hexdigest(), "md5": md5.hexdigest()}


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Writes `data` to a temp file beside `path`, fsyncs it and renames it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Atomic UTF-8 text write."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, value: Any) -> Path:
    """Atomic, pretty, key-sorted JSON write (stable bytes for the same value)."""
    return atomic_write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def read_json(path: str | Path) -> Any:
    """Reads a JSON file."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


@contextlib.contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yields a temp directory beside `final`; on success renames it to `final`, on error removes it.

    `final` must not exist yet: callers decide beforehand whether existing output is reusable.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    try:
        yield temp
        os.replace(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
