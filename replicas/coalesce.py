"""One reconcile at a time, however many are asked for.

Every change that may need the cluster converged asks for a reconcile
(``replicas.enqueue``); a lost node holding k replicas asks about 2k+1 times
within a second. A pass looks at the whole cluster, so one pass that starts
after a request serves every request made before it. Two marks and a lock
make that so across every worker of the deployment:

- *owed*: a pass is owed. A request sets it before it sends anything; a task
  that is a request of its own (beat's tick, a delayed request) sets it when
  it runs.
- *queued*: a task message is on its way to a lock holder. A request sends
  one only if it sets this mark (set-if-absent, expiring, so that a message
  lost with its broker silences nothing for long); the lock holder clears it
  before each pass, so at most one message is sent per pass.
- the *lock*: held while passes run. The holder takes the owed mark before
  each pass and runs another while it finds it set again. A task that finds
  the lock held leaves the mark for the holder. After releasing the lock the
  holder looks once more: a task that found the lock held just before the
  release left its mark there, and nobody else would run its pass.

So at most one pass runs and one is owed, and a request made while a pass
runs gets one more pass after it: no lost wakeup, and no wait for one when
nothing runs. The marks live in Redis (``LLMGW_REDIS_URL``), as liveness
does; the embedded default, which has no Redis, keeps them as files in the
data directory (it is one host). The lock is a PostgreSQL advisory lock (a
file lock on SQLite), released by the database or the kernel when the process
holding it dies, so that a worker killed in a pass blocks no later one.

Coalescing is a saving, never a condition: while the marks cannot be read
(Redis away), a request sends its message and a task waits for the lock and
runs one pass. The periodic reconcile (beat) stays as it was.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import redis
from django.conf import settings
from django.db import connection

logger = logging.getLogger(__name__)

OWED_KEY = "llmgw:replicas:reconcile:owed"
QUEUED_KEY = "llmgw:replicas:reconcile:queued"
# A message claimed this long ago and not yet picked up (lost with a broker
# or a worker) stops holding requests back.
QUEUED_FOR = 10
# pg_advisory_lock's key: any int8 that no other lock of this database uses.
ADVISORY_KEY = 0x6C6C6D67770001  # "llmgw" + 1

# While these are raised, coalescing is off and the pass runs anyway.
MARKS_UNAVAILABLE = (redis.RedisError, OSError)


class Marks(Protocol):
    def owe(self) -> None: ...
    def owe_and_claim(self) -> bool: ...
    def take(self) -> bool: ...
    def owed(self) -> bool: ...
    def unclaim(self) -> None: ...


class Lock(Protocol):
    def try_acquire(self) -> bool: ...
    def acquire(self) -> None: ...
    def release(self) -> None: ...


class RedisMarks:
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)

    def owe(self) -> None:
        self.client.set(OWED_KEY, 1)

    def owe_and_claim(self) -> bool:
        """Mark a pass owed; True if the caller is to send the message."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(OWED_KEY, 1)
        pipe.set(QUEUED_KEY, 1, nx=True, ex=QUEUED_FOR)
        return bool(pipe.execute()[1])

    def take(self) -> bool:
        """Before a pass: clear both marks; True if a pass was owed."""
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(QUEUED_KEY)
        pipe.getdel(OWED_KEY)
        return pipe.execute()[1] is not None

    def owed(self) -> bool:
        return bool(self.client.exists(OWED_KEY))

    def unclaim(self) -> None:
        self.client.delete(QUEUED_KEY)


class FileMarks:
    """The same marks as files: creating, testing and unlinking a file are
    atomic on one host, which is all the embedded default has."""

    def __init__(self, directory: Path) -> None:
        self.owed_path = directory / "reconcile.owed"
        self.queued_path = directory / "reconcile.queued"

    def owe(self) -> None:
        self.owed_path.touch()

    def owe_and_claim(self) -> bool:
        self.owe()
        try:
            os.close(os.open(self.queued_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                stale = time.time() - self.queued_path.stat().st_mtime > QUEUED_FOR
            except FileNotFoundError:
                stale = True  # taken meanwhile: the pass it stood for has not started yet
            if stale:
                self.queued_path.unlink(missing_ok=True)
                return self.owe_and_claim()
            return False

    def take(self) -> bool:
        self.queued_path.unlink(missing_ok=True)
        try:
            self.owed_path.unlink()
            return True
        except FileNotFoundError:
            return False

    def owed(self) -> bool:
        return self.owed_path.exists()

    def unclaim(self) -> None:
        self.queued_path.unlink(missing_ok=True)


class AdvisoryLock:
    """A session lock of PostgreSQL on this thread's connection (each worker
    thread has its own): it dies with the connection."""

    def try_acquire(self) -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [ADVISORY_KEY])
            return bool(cursor.fetchone()[0])

    def acquire(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [ADVISORY_KEY])

    def release(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [ADVISORY_KEY])


class FileLock:
    """flock(2) on a file of the data directory. Each acquisition opens the
    file anew, so that two threads of one process exclude each other too
    (flock belongs to the open file, not to the process)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._held = threading.local()

    def _lock(self, flags: int) -> bool:
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            os.close(fd)
            return False
        self._held.fd = fd
        return True

    def try_acquire(self) -> bool:
        return self._lock(fcntl.LOCK_EX | fcntl.LOCK_NB)

    def acquire(self) -> None:
        self._lock(fcntl.LOCK_EX)

    def release(self) -> None:
        fd = self._held.fd
        self._held.fd = None
        os.close(fd)  # closing the last descriptor of the open file drops the lock


@dataclass
class Gate:
    marks: Marks
    lock: Lock


_gates: dict[tuple, Gate] = {}
_gates_lock = threading.Lock()


def reconcile_gate() -> Gate:
    """The process's gate, as the settings say (Redis or files for the marks,
    PostgreSQL or a file for the lock)."""
    postgres = "postgresql" in settings.DATABASES["default"]["ENGINE"]
    key = (settings.LLMGW_REDIS_URL, str(settings.DATA_DIR), postgres)
    with _gates_lock:
        gate = _gates.get(key)
        if gate is None:
            marks = RedisMarks(settings.LLMGW_REDIS_URL) if settings.LLMGW_REDIS_URL else FileMarks(settings.DATA_DIR)
            lock = AdvisoryLock() if postgres else FileLock(settings.DATA_DIR / "reconcile.lock")
            gate = _gates[key] = Gate(marks=marks, lock=lock)
    return gate


def reconcile_ask(*, gate: Gate, send: Callable[[bool], None]) -> None:
    """A request, after its transaction committed: mark a pass owed, and send
    a message unless one is on its way already. ``send(marked)``: marked is
    False when the marks could not be written (the task then owes its own)."""
    try:
        if not gate.marks.owe_and_claim():
            return
        marked = True
    except MARKS_UNAVAILABLE as exc:
        logger.warning("reconcile marks unreadable (%s): asking for a pass without coalescing", exc)
        marked = False
    try:
        send(marked)
    except BaseException:
        try:
            gate.marks.unclaim()
        except MARKS_UNAVAILABLE:
            pass  # it expires
        raise


def reconcile_passes(*, gate: Gate, run: Callable[[], None], owe: bool) -> int:
    """A task's part: run passes while one is owed, unless another worker is
    running them. ``owe``: this task is a request of its own (beat's tick, a
    delayed request), not the message of a request that marked its pass.
    Returns how many passes this call ran."""
    passes = 0
    try:
        if owe:
            _marks(gate.marks.owe)
        while True:
            if not gate.lock.try_acquire():
                # The holder runs what is owed, if it can read the marks (or this raises).
                _marks(gate.marks.owed)
                if not passes:
                    # At most once per pass (the queued mark), so worth a line.
                    logger.info("reconcile asked for while a pass runs elsewhere: that worker runs one more after it")
                break
            try:
                while _marks(gate.marks.take):
                    passes += 1
                    _pass(run, passes)
            finally:
                gate.lock.release()
            # A task that found the lock held since the last take left its mark for us.
            if not _marks(gate.marks.owed):
                break
        if passes > 1:
            logger.info("reconcile ran %d passes in a row: changes made during a pass asked for one more", passes)
        return passes
    except _MarksAway as away:
        logger.warning("reconcile marks unreadable (%s): waiting for the lock to run one pass", away.__cause__)
    gate.lock.acquire()
    try:
        _pass(run, passes + 1)
    finally:
        gate.lock.release()
    return passes + 1


class _MarksAway(Exception):
    """The marks could not be read or written (not an error of the pass)."""


def _marks(operation: Callable[[], bool | None]) -> bool | None:
    try:
        return operation()
    except MARKS_UNAVAILABLE as exc:
        raise _MarksAway() from exc


def _pass(run: Callable[[], None], number: int) -> None:
    start = time.perf_counter()
    run()
    logger.debug("reconcile pass %d of this task took %.0f ms", number, (time.perf_counter() - start) * 1000)
