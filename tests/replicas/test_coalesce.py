"""One reconcile at a time (replicas.coalesce): however many requests, at most
one pass runs and one is owed, and a request made while a pass runs gets one
more pass after it.

The gate is driven by threads standing in for worker threads, on both of its
backends (Redis marks with PostgreSQL's advisory lock; files with flock, as on
the embedded default), then through a real Celery worker on Redis.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from replicas import coalesce, enqueue
from replicas.models import CatalogEntry, Replica
from tests.control_plane import celery_factory, redis_url, wait_until  # noqa: F401 - fixture

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["redis+postgresql", "files+flock"])
def gate(request, tmp_path):
    if request.param == "redis+postgresql":
        marks = coalesce.RedisMarks(redis_url())
        marks.client.delete(coalesce.OWED_KEY, coalesce.QUEUED_KEY)
        return coalesce.Gate(marks=marks, lock=coalesce.AdvisoryLock())
    return coalesce.Gate(marks=coalesce.FileMarks(tmp_path), lock=coalesce.FileLock(tmp_path / "reconcile.lock"))


class Worker:
    """Tasks as a worker runs them: each message in a thread of its own, with
    its own database connection."""

    def __init__(self, gate: coalesce.Gate, run) -> None:
        self.gate, self.run = gate, run
        self.sent = 0
        self.results: list[int] = []
        self.threads: list[threading.Thread] = []

    def send(self, marked: bool) -> None:
        self.sent += 1
        thread = threading.Thread(target=self._task, args=(marked,))
        self.threads.append(thread)
        thread.start()

    def _task(self, marked: bool) -> None:
        try:
            self.results.append(coalesce.reconcile_passes(gate=self.gate, run=self.run, owe=not marked))
        finally:
            connection.close()

    def ask(self) -> None:
        coalesce.reconcile_ask(gate=self.gate, send=self.send)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=30)
            assert not thread.is_alive()


def test_requests_during_a_pass_make_one_more_pass(gate):
    first_started, first_may_end = threading.Event(), threading.Event()
    passes: list[int] = []

    def run() -> None:
        passes.append(len(passes) + 1)
        if len(passes) == 1:
            first_started.set()
            assert first_may_end.wait(30)

    worker = Worker(gate, run)
    worker.ask()
    assert first_started.wait(30)
    for _ in range(20):
        worker.ask()
    # The one message these twenty sent has been run, and found the lock held.
    wait_until(lambda: worker.results == [0], timeout=10, message="the second task to give way")
    assert worker.sent == 2 and passes == [1]
    first_may_end.set()
    worker.join()
    assert passes == [1, 2]  # one more pass, not twenty
    assert worker.results == [0, 2]
    assert not gate.marks.owed()


def test_a_request_just_before_the_lock_is_released_is_not_lost(gate):
    """The narrowest window: the holder has found nothing owed and has not yet
    released the lock when a request comes and its task finds the lock held."""
    worker = Worker(gate, run=lambda: passes.append(len(passes) + 1))
    passes: list[int] = []
    take = gate.marks.take
    window = {"open": True}

    def take_then_request() -> bool:
        owed = take()
        if not owed and window.pop("open", False):
            worker.ask()
            # Its task ran, and gave way to the holder, which is still us.
            wait_until(lambda: worker.results == [0], timeout=10, message="the late task to give way")
        return owed

    gate.marks.take = take_then_request
    worker.ask()
    worker.join()
    assert "open" not in window, "the window was never reached"
    assert passes == [1, 2], "the request made in the window got no pass"
    assert worker.results == [0, 2]


def test_an_idle_gate_runs_the_pass_at_once(gate):
    passes = []
    worker = Worker(gate, run=lambda: passes.append(1))
    worker.ask()
    worker.join()
    assert passes == [1] and worker.results == [1]
    assert not gate.marks.owed()


def test_without_its_marks_every_request_is_sent_and_run():
    """Redis away: coalescing stops, nothing is lost."""
    gate = coalesce.Gate(marks=coalesce.RedisMarks("redis://127.0.0.1:1/0"), lock=coalesce.AdvisoryLock())
    first_started, first_may_end = threading.Event(), threading.Event()
    passes = []

    def run() -> None:
        passes.append(1)
        if len(passes) == 1:
            first_started.set()
            assert first_may_end.wait(30)

    worker = Worker(gate, run)
    worker.ask()
    assert first_started.wait(30)
    worker.ask()  # while the first pass runs: its task cannot leave a mark, so it waits
    wait_until(lambda: _a_backend_waits_for_the_advisory_lock(), timeout=10, message="the second task to wait")
    first_may_end.set()
    worker.join()
    assert worker.sent == 2 and passes == [1, 1]


def test_a_real_worker_coalesces_and_loses_no_wakeup(celery_factory):  # noqa: F811
    """A pass blocked on a catalog row; twenty requests meanwhile, after a
    change the blocked pass has already walked past: exactly one more pass
    runs, and it makes what the change asks for."""
    url = redis_url()
    coalesce.RedisMarks(url).client.flushdb()
    early = CatalogEntry.objects.create(name="early", engine="sim", weights="/m", nodes=1, gpus_per_node=1, replicas=0)
    late = CatalogEntry.objects.create(name="late", engine="sim", weights="/m", nodes=1, gpus_per_node=1, replicas=0)
    worker = celery_factory("worker", CELERY_BROKER_URL=url, LLMGW_REDIS_URL=url)
    worker.wait_ready()

    locked, unlock = threading.Event(), threading.Event()

    def hold_late_row() -> None:
        try:
            with transaction.atomic():
                CatalogEntry.objects.select_for_update().get(pk=late.pk)
                locked.set()
                unlock.wait(60)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_late_row)
    holder.start()
    try:
        assert locked.wait(10)
        enqueue.reconcile_request()
        wait_until(_a_backend_waits_for_a_row_lock, timeout=20, message="the worker's pass to block on the row")
        CatalogEntry.objects.filter(pk=early.pk).update(replicas=2)  # walked past already
        for _ in range(20):
            enqueue.reconcile_request()
        wait_until(lambda: "reconcile asked for while a pass runs elsewhere" in worker.log(),
                   timeout=20, message="the second task to find a pass running and give way")
        assert not Replica.objects.filter(model=early).exists()
    finally:
        unlock.set()
        holder.join(timeout=10)
    wait_until(lambda: Replica.objects.filter(model=early).count() == 2, timeout=20,
               message="the pass owed to the requests made meanwhile")
    wait_until(lambda: "reconcile ran 2 passes in a row" in worker.log(), timeout=20, message="the first task to end")
    log = worker.log()
    assert log.count("reconcile asked for while a pass runs elsewhere") == 1, log  # one message for twenty requests
    assert log.count("reconcile ran ") == 1, log  # no third pass
    assert not coalesce.RedisMarks(url).owed()


def _a_backend_waits_for_the_advisory_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return cursor.fetchone()[0] > 0


def _a_backend_waits_for_a_row_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0] > 0
