"""One harness for tests/, scripts/ and bench/ (and flows/local_pool.py): ports, processes, servers, digests.

harness.ports      HOST (127.0.0.1, the only address anything binds) and free_port()
harness.processes  children in their own process group, logging to a file, stopped all at once
harness.prefect    a Prefect process's isolated environment; the busy-retrying REST client
harness.servers    a Prefect server, a worker, an MLflow tracking or model server, started and awaited
harness.compose    docker/compose.yaml's variables, interpolated as compose does; its secrets, generated
harness.digests    a file's SHA-256, or the one recorded beside an archive
harness.fuzz       the fuzz suite's Hypothesis profiles (ci in make test, fuzz in make fuzz)
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
