"""The worker image's entry point on SIGTERM: its flow runs stop (and save) before the Prefect worker does.

`docker stop` signals the container's init, which may pass the signal to the entry point's whole process
group. Prefect's worker would then stop at once, and its flow runs (each in a session of its own) die
with the container, unsaved. A stand-in `prefect` on PATH plays the worker: it starts one "flow run" in a
new session, as Prefect's process worker does, and records which process got which signal when.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from harness import REPO_ROOT

FAKE_PREFECT = r"""#!/usr/bin/env bash
# Every setup command succeeds; `worker start` runs a worker with one flow run that takes a second to save.
log=$FAKE_LOG
if [[ "$1 $2" == "worker start" ]]; then
    setsid bash -c 'trap "echo flow-run-stopping >> $0; sleep 1; echo flow-run-saved >> $0; exit 1" TERM
                    echo flow-run-started >> $0; while :; do sleep 0.1; done' "$log" &
    trap "echo worker-stopping >> $log; exit 0" TERM INT
    echo worker-started >> "$log"
    while :; do sleep 0.1; done
fi
exit 0
"""


def stand_in_automations(app_dir: Path) -> None:
    """The entry point makes the pool, the automations and the deployments with `python flows/worker_setup.py`
    (from the image's /app): here a stand-in that does nothing, as the stand-in `prefect` does."""
    (app_dir / "flows").mkdir()
    (app_dir / "flows" / "worker_setup.py").write_text("")


@pytest.mark.slow
def test_sigterm_to_the_worker_container_stops_its_flow_runs_first_then_the_worker(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in_automations(tmp_path)
    (bin_dir / "prefect").write_text(FAKE_PREFECT)
    (bin_dir / "prefect").chmod(0o755)
    log = tmp_path / "signals.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "HOME": str(tmp_path)}
    entrypoint = subprocess.Popen(
        ["bash", str(REPO_ROOT / "docker" / "entrypoint.sh"), "worker"],
        env=env, cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and {"worker-started", "flow-run-started"} <= set(log.read_text().split())):
            assert time.monotonic() < deadline and entrypoint.poll() is None, entrypoint.communicate(timeout=5)
            time.sleep(0.1)
        os.killpg(entrypoint.pid, signal.SIGTERM)  # What an init that signals the whole group sends.
        _, stderr = entrypoint.communicate(timeout=60)
    finally:
        if entrypoint.poll() is None:
            os.killpg(entrypoint.pid, signal.SIGKILL)
    assert entrypoint.returncode == 0, stderr
    events = log.read_text().split()
    assert events[-3:] == ["flow-run-stopping", "flow-run-saved", "worker-stopping"], events
    assert "SIGTERM: stopping the flow runs' processes" in stderr
    leftovers = subprocess.run(["pgrep", "-f", str(log)], capture_output=True, text=True).stdout.split()
    assert leftovers == [], "a flow run outlived its container's entry point"


def test_the_worker_exiting_by_itself_ends_the_entry_point_with_its_status(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in_automations(tmp_path)
    (bin_dir / "prefect").write_text('#!/usr/bin/env bash\n[[ "$1 $2" == "worker start" ]] && exit 3\nexit 0\n')
    (bin_dir / "prefect").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(REPO_ROOT / "docker" / "entrypoint.sh"), "worker"], env=env, cwd=Path(tmp_path),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 3, done.stderr
