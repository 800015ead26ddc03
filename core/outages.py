"""The control plane's own dependencies going away: PostgreSQL and Redis.

Each process keeps one ``Dependency`` per service it needs. Whatever notices
a failure says so (``failed``): the first one logs at once what cannot be done
while it lasts. Whatever notices it working again says so (``recovered``):
then one Event records the outage and how long it lasted, written once the
database can take it, and only once for the whole cluster although every
process saw the same outage.

``unavailable`` tells an exception that means "a dependency is away" (answer
503 with Retry-After, and try again) from a bug (a 500).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass

import redis
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction

from .choices import CoreEventKind, EventSeverity
from .events import event_record
from .models import Event

logger = logging.getLogger(__name__)

RETRY_AFTER = 2  # seconds, in every 503 for a dependency that is away
# While a dependency is away, the agent API's heartbeats try it at most this
# often instead of on every request (each try may wait for a timeout).
TRY_EVERY = 1.0

REDIS = "redis"
DATABASE = "database"
DESCRIPTION = {
    REDIS: "Redis (heartbeat liveness, wake-ups and the task broker)",
    DATABASE: "the database (PostgreSQL)",
}
# SQLSTATE classes and codes that mean "cannot talk to the server now"; a
# deadlock or a serialization failure is an OperationalError too, but not an outage.
_DB_OUTAGE_STATES = ("08", "57P01", "57P02", "57P03", "53300")


def unavailable(exc: BaseException) -> str | None:
    """The dependency ``exc`` says is away (``REDIS``, ``DATABASE``), or None."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)):
        return REDIS
    if isinstance(exc, redis.ReadOnlyError):
        return REDIS
    if isinstance(exc, InterfaceError):
        return DATABASE
    if isinstance(exc, OperationalError):
        cause = exc.__cause__
        state = getattr(cause, "sqlstate", None)
        if state is None or state.startswith(_DB_OUTAGE_STATES):
            return DATABASE
    return None


def unavailable_message(dependency: str, exc: BaseException | None = None) -> str:
    detail = f" ({_one_line(exc)})" if exc is not None else ""
    return (
        f"{DESCRIPTION[dependency]} is unreachable from the control plane{detail}; nothing was changed. "
        f"Try again in a few seconds; if it lasts, see 'Faults' in docs/operations.md"
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]


@dataclass
class _Outage:
    down_at: float
    back_at: float
    cause: str


class Dependency:
    """One service this process needs, as this process has seen it lately."""

    def __init__(self, name: str, consequence: str) -> None:
        self.name = name
        self.consequence = consequence
        self.down_since: float | None = None
        self.cause = ""
        self._next_try = 0.0
        self._unrecorded: list[_Outage] = []
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def worth_trying(self) -> bool:
        """While it is known to be away, True for one caller per ``TRY_EVERY``
        (the others answer from what they know rather than each wait for a
        timeout); always True while it is up."""
        if self.down_since is None:
            return True
        with self._lock:
            now = time.monotonic()
            if now < self._next_try:
                return False
            self._next_try = now + TRY_EVERY
            return True

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self._next_try = time.monotonic() + TRY_EVERY
            if self.down_since is not None:
                return
            self.down_since = time.time()
            self.cause = _one_line(exc)
        logger.error("dependency=%s unreachable: %s; %s", self.name, self.cause, self.consequence)

    def recovered(self) -> None:
        if self.down_since is None and not self._unrecorded:
            return
        with self._lock:
            if self.down_since is not None:
                outage = _Outage(self.down_since, time.time(), self.cause)
                self.down_since = None
                self._unrecorded.append(outage)
                logger.warning(
                    "dependency=%s reachable again after %.1fs", self.name, outage.back_at - outage.down_at
                )
        self.flush()

    def flush(self) -> None:
        """Record the outages seen and not recorded yet (needs the database)."""
        if not self._unrecorded:
            return
        with self._lock:
            pending, self._unrecorded = self._unrecorded, []
        for i, outage in enumerate(pending):
            try:
                outage_record(dependency=self.name, outage=outage)
            except DatabaseError as exc:
                # The database is away (or was the one away and is not quite
                # back): keep the record for the next time this is called.
                with self._lock:
                    self._unrecorded[:0] = pending[i:]
                logger.info("dependency=%s outage not recorded yet: %s", self.name, _one_line(exc))
                return


# pg_advisory_xact_lock's key for outage_record (any constant no other lock uses).
_OUTAGE_LOCK = 0x6C6C6D67_6F757467 & 0x7FFFFFFFFFFFFFFF


def _outage_lock() -> None:
    """Hold the cluster-wide outage lock until the transaction ends. SQLite's
    transactions are IMMEDIATE (settings): its writers queue already."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_OUTAGE_LOCK])


def outage_record(*, dependency: str, outage: _Outage) -> None:
    """One Event per outage for the whole cluster: every process that saw it
    reports it, the first to get here writes it (the others wait on the
    lock, then find its Event)."""
    subject = f"dependency/{dependency}"
    with transaction.atomic():
        _outage_lock()
        if Event.objects.filter(kind=CoreEventKind.CONTROL_PLANE, subject=subject,
                                data__back_at__gte=outage.down_at).exists():
            return
        seconds = outage.back_at - outage.down_at
        down = dt.datetime.fromtimestamp(outage.down_at, tz=dt.timezone.utc)
        event_record(
            kind=CoreEventKind.CONTROL_PLANE,
            subject=subject,
            message=f"{DESCRIPTION[dependency]} was unreachable for {seconds:.0f}s from "
            f"{down:%Y-%m-%d %H:%M:%S} UTC ({outage.cause}); it is back",
            severity=EventSeverity.WARNING,
            data={"dependency": dependency, "down_at": outage.down_at, "back_at": outage.back_at,
                  "seconds": round(seconds, 1)},
        )


redis_dependency = Dependency(
    REDIS,
    "heartbeats cannot be recorded as liveness (the sweep holds every failover until Redis is back "
    "and then gives every node a fresh grace period); heartbeats are answered from the database and "
    "their times kept in memory until they can be written",
)
database_dependency = Dependency(
    DATABASE,
    "heartbeats are answered from what this process already knows (inventory changes wait until it "
    "is back); nodes this process has not seen yet, and the operator API, answer 503",
)
DEPENDENCIES = {REDIS: redis_dependency, DATABASE: database_dependency}


def dependency_failed(exc: BaseException) -> str | None:
    """Note ``exc`` against the dependency it says is away; return that dependency's name."""
    name = unavailable(exc)
    if name is not None:
        DEPENDENCIES[name].failed(exc)
    return name


_watch_lock = threading.Lock()
_watching = False


def database_watch_start() -> None:
    """In the agent API: notice the database coming back (and going away while
    no heartbeat needs it), once a second, on one connection of its own."""
    global _watching
    with _watch_lock:
        if _watching:
            return
        _watching = True
    threading.Thread(target=_database_watch, name="database-watch", daemon=True).start()


def _database_watch() -> None:
    while True:
        try:
            _database_probe()
        except DatabaseError as exc:
            database_dependency.failed(exc)
        else:
            database_dependency.recovered()
            redis_dependency.flush()  # an outage of Redis seen while the database was away too
        time.sleep(TRY_EVERY)


def _database_probe() -> None:
    """SELECT 1 on the database. With a pool, on a connection of its own: a
    pool whose connections failed retries with a backoff of up to a minute,
    so once the database answers here the pool is made anew at once."""
    if not connection.settings_dict.get("OPTIONS", {}).get("pool"):
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        finally:
            connection.close_if_unusable_or_obsolete()
        return
    params = {**connection.get_connection_params(), "connect_timeout": 2}
    with connection.wrap_database_errors:
        with connection.Database.connect(**params) as direct:
            direct.execute("SELECT 1")
    if database_dependency.down:
        connection.close_pool()
