"""A throwaway PostgreSQL cluster on 127.0.0.1, without Docker, through scripts/postgres.sh.

reason = install_postgres()          # None once the server is installed (apt when missing)
with postgres_cluster(port, user="cifar", password=secret) as directory:
    ...                              # the superuser `user` on 127.0.0.1:`port`; removed on exit
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from harness import REPO_ROOT

POSTGRES_SCRIPT = REPO_ROOT / "scripts" / "postgres.sh"


def install_postgres() -> str | None:
    """Installs PostgreSQL when missing (a fast no-op when present); the reason it cannot be had, or None."""
    try:
        result = subprocess.run(["bash", str(POSTGRES_SCRIPT), "install"], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    return None if result.returncode == 0 else result.stderr.strip()[-500:]


@contextlib.contextmanager
def postgres_cluster(port: int, *, user: str, password: str) -> Iterator[Path]:
    """A new cluster on 127.0.0.1:`port` whose superuser is `user`; yields its directory, stops and removes it."""
    # Outside pytest's private temporary root: as root, the cluster belongs to the `postgres` user.
    directory = Path(tempfile.mkdtemp(prefix="cifar-postgres-", dir="/tmp"))
    environment = {**os.environ, "POSTGRES_USER": user, "POSTGRES_PASSWORD": password}
    try:
        argv = ["bash", str(POSTGRES_SCRIPT), "start", str(directory), str(port)]
        result = subprocess.run(argv, env=environment, capture_output=True, text=True, timeout=180)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        yield directory
    finally:
        subprocess.run(["bash", str(POSTGRES_SCRIPT), "stop", str(directory)], capture_output=True, timeout=120)
        shutil.rmtree(directory, ignore_errors=True)
