"""The agent API's background threads and the database connection pool.

With a pool (``LLMGW_DB_POOL_MAX`` connections per worker), a thread holds
the connection it took until it closes it. The pool threads do so after
every request; the background threads (revoked serials, the listener's
liveness mark, the desired-state poll) must too, or three of them hold three
of the pool's few connections for good and requests wait for one until they
fail with 503.
"""

from django.db import connection


def release_database_connection() -> None:
    """Give this thread's connection back to the pool (without a pool, keep
    it: reconnecting every second would cost more than it frees)."""
    if connection.settings_dict.get("OPTIONS", {}).get("pool"):
        connection.close()
