"""Creates Prefect's own SQLite database and registers its block types, once, for runs without a server.

`python flows/pipeline.py` with no PREFECT_API_URL starts a temporary Prefect server per run, and on
start-up each server migrates the database and, unless the memo store (PREFECT_HOME/memo_store.toml)
says it was done, inserts Prefect's block types. Runs started at once on a new PREFECT_HOME would do
both together and collide (`UNIQUE constraint failed: block_type.slug`: the server exits, the run
with it). `flows.runtime.prepare_ephemeral_database` runs this script in a child process under a lock
first; it does what a server's start-up does, with the server's own memo, so later servers skip it.
"""

from __future__ import annotations

import asyncio


async def prepare() -> None:
    # Private, but it is the start-up's own memo: the hash a server compares is the one written here.
    from prefect.server.api.server import _memoize_block_auto_registration
    from prefect.server.database import provide_database_interface
    from prefect.server.models.block_registration import run_block_auto_registration

    database = provide_database_interface()
    await database.create_db()  # Migrates to the installed Prefect's head, as `database upgrade` does.

    @_memoize_block_auto_registration
    async def register_block_types() -> None:
        async with await database.session() as session:
            await run_block_auto_registration(session=session)

    await register_block_types()


if __name__ == "__main__":
    asyncio.run(prepare())
