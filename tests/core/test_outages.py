"""One Event per outage for the whole cluster, however many processes saw it
and however close together they report it."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from core import outages
from core.models import Event

pytestmark = pytest.mark.skipif(connection.vendor != "postgresql", reason="SQLite's IMMEDIATE transactions queue writers")


def _waiting_on_advisory_lock() -> int:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_a_second_reporter_waits_for_the_first_then_finds_its_event():
    now = time.time()
    outage = outages._Outage(down_at=now - 20, back_at=now, cause="refused")
    done = threading.Event()

    def second_process() -> None:
        try:
            outages.outage_record(dependency=outages.REDIS, outage=outage)
        finally:
            connections.close_all()
            done.set()

    # The first reporter holds the lock and has not written its Event yet.
    with transaction.atomic():
        outages._outage_lock()
        second = threading.Thread(target=second_process)
        second.start()
        deadline = time.monotonic() + 10
        while _waiting_on_advisory_lock() == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _waiting_on_advisory_lock() == 1, "the second reporter never queued on the lock"
        assert not done.is_set()
        outages.outage_record(dependency=outages.REDIS, outage=outage)  # the first writes (same transaction)
    assert done.wait(10)
    second.join(5)
    (event,) = Event.objects.filter(subject="dependency/redis")
    assert event.data["back_at"] == now
