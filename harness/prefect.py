"""A Prefect process isolated from the user's profile, and a REST client that waits out a busy server.

env = prefect_env(tmp / "prefect", api_url)                  # for `prefect ...` and flow subprocesses
env = prefect_env(tmp / "new-home", prepared=False)          # a home whose database nobody prepared yet
prefect_api.post(f"{api_url}/flow_runs/filter", json={})     # a busy 503, a timed-out read retried
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from cifar import locks
from harness import REPO_ROOT
from harness.processes import BIN_DIR

# What a prepared Prefect home holds: the migrated database, its record of the Prefect it was prepared
# for (flows.runtime.prepare_ephemeral_database) and the memo of Prefect's block-type registration.
PREPARED_HOME_FILES = ("prefect.db", ".prefect.db.prepared", "memo_store.toml")

# Every Prefect server we start keeps the leases of concurrency slots (the `training` limit) in files under
# its PREFECT_HOME, as scripts/prefect_server.sh and docker/compose.yaml do. With Prefect's default (memory),
# a server restarted under a running training forgets the lease, the holder's release finds nothing, and
# the slot stays taken: every later training waits for it forever (docs/ORCHESTRATION.md).
SERVER_SETTINGS = {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem"}


def isolated_prefect_env(
    home: Path, api_url: str | None = None, *, base: Mapping[str, str] | None = None, **extra: str
) -> dict[str, str]:
    """`base` (default: this process's environment) with Prefect pointed at `home`, nothing of the user's
    profile or PREFECT_* settings, no analytics, no prompts. `api_url=None`: no server (the client starts an
    ephemeral one)."""
    base = os.environ if base is None else base
    env = {key: value for key, value in base.items() if not key.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_PROFILES_PATH=str(Path(home) / "profiles.toml"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_CLI_PROMPT="false",
    )
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env.update(extra)
    return env


def prefect_env(home: Path, api_url: str | None = None, *, prepared: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a Prefect child process of a test or a bench, isolated in `home` (created): INFO
    logs, TensorFlow quiet, output unbuffered, this venv's programs first on PATH. `prepared`: a new home
    starts from a copy of a migrated database (~12 s of migrations saved per home); False for what tests
    the preparation itself."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    if prepared and not (home / "prefect.db").exists():
        for name in PREPARED_HOME_FILES:
            shutil.copy2(prepared_home() / name, home / name)
    quiet = {"PREFECT_LOGGING_LEVEL": "INFO", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
    path = f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    return isolated_prefect_env(home, api_url, **{**quiet, "PATH": path, **extra})


def prepared_home() -> Path:
    """A Prefect home prepared once (by the CLI's own preparation) under $CIFAR_CACHE_DIR, or the temp dir.

    A copy made by an older Prefect is harmless: the CLI sees its record differ and migrates it again,
    and a server migrates its database when it starts."""
    home = Path(os.environ.get("CIFAR_CACHE_DIR") or tempfile.gettempdir()) / "prepared-prefect-home"
    with locks.exclusive(home.with_name(home.name + ".lock"), "the prepared Prefect home"):
        if not all((home / name).exists() for name in PREPARED_HOME_FILES):
            building = Path(tempfile.mkdtemp(prefix=home.name + ".", dir=home.parent))
            prepare = "from flows.runtime import prepare_ephemeral_database as prepare; prepare()"
            environment = isolated_prefect_env(building)
            subprocess.run([sys.executable, "-c", prepare], cwd=REPO_ROOT, env=environment, check=True, timeout=300)
            shutil.rmtree(home, ignore_errors=True)
            building.rename(home)
    return home


class BusyRetryingTransport(httpx.HTTPTransport):
    """Retries as Prefect's own client does: a 429, 502 or 503, which a server answers when it is busy (its
    SQLite database locked by a scheduler or a flow run writing at that moment), and, for requests that
    only read, a timeout (the database locked longer than the request may wait, seen in CI with a dozen
    flow runs starting at once). Neither is a failure of what a test or a check looks at. Writes are not
    repeated after a timeout: the server may have done them. Serves MLflow's REST API as well."""

    TRANSIENT = (httpx.ReadTimeout, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.RemoteProtocolError)
    BUSY = {429, 502, 503}

    def __init__(self, attempts: int = 6, **kwargs) -> None:
        super().__init__(**kwargs)
        self.attempts = attempts

    @staticmethod
    def reads_only(request: httpx.Request) -> bool:
        """GET, and the POSTs that only query: Prefect's /filter and /count, MLflow's /search."""
        return request.method == "GET" or request.url.path.endswith(("/filter", "/count", "/search"))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(1, self.attempts):
            try:
                response = super().handle_request(request)
            except self.TRANSIENT:
                if not self.reads_only(request):
                    raise
            else:
                if response.status_code not in self.BUSY:
                    return response
                response.close()
            time.sleep(2 * attempt)  # Seconds: 30 in all over 6 attempts, like the client's own backoff.
        return super().handle_request(request)


# For the REST calls of tests and checks; 60 s is the Prefect client's own request timeout.
prefect_api = httpx.Client(transport=BusyRetryingTransport(), timeout=60)
