#!/usr/bin/env bash
# `prefect server start "$@"`, with Prefect 3.8.8's SQLite event writer made idempotent.
#
#   scripts/prefect_server.sh --host 127.0.0.1 --port 4200
#
# Why: docs/ORCHESTRATION.md, "NOT NULL constraint failed: events.occurred".
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then  # The checkout's venv, else the python on PATH (an image, another install).
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" - "$@" <<'PY'
import os
import sys

# Leases of concurrency slots in files under PREFECT_HOME, not in this process's memory: a restart under a
# running training would otherwise strand its `training` slot for good (docs/ORCHESTRATION.md).
os.environ.setdefault("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE", "prefect.server.concurrency.lease_storage.filesystem")

import prefect
import sqlalchemy as sa

# Events reach the server at least once, and on SQLite Prefect's `_write_sqlite_events` runs `INSERT ...
# VALUES ()` with no rows when every event of a batch is already stored (and fails on the primary key when
# one event appears twice in a batch): the duplicates are dropped before Prefect's writer sees them, then
# the ordinary `prefect server start` runs in this process (one API worker, the default). Other Prefect
# versions start unpatched, with a warning. On PostgreSQL the patch is a no-op.
if prefect.__version__ == "3.8.8":
    from prefect.server.database import provide_database_interface
    from prefect.server.events.services import event_persister
    from prefect.server.events.storage import database as event_storage

    prefect_write_events = event_storage.write_events

    async def write_events(session, events):
        """Prefect's writer without the duplicates it cannot handle on SQLite."""
        unique = list({event.id: event for event in events}.values())  # Repeats within the batch.
        if unique:
            db = provide_database_interface()
            ids = [event.id for event in unique]
            stored = set((await session.scalars(sa.select(db.Event.id).where(db.Event.id.in_(ids)))).all())
            unique = [event for event in unique if event.id not in stored]  # Redelivered ones.
        if unique:
            await prefect_write_events(session, unique)

    event_storage.write_events = write_events
    event_persister.write_events = write_events
else:
    print(f"prefect_server.sh: the event writer patch targets Prefect 3.8.8, not {prefect.__version__}; "
          "starting unpatched", file=sys.stderr)

from prefect.cli import app

sys.argv = ["prefect", "server", "start", *sys.argv[1:]]
app()
PY
