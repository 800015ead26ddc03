"""issue 27: the web process's PostgreSQL connections stay at their bound
however many requests it answers (they once climbed to 16: Django's ASGI
handler runs each request in a thread of its own, and each such thread kept
its connection for LLMGW_DB_CONN_MAX_AGE seconds)."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from django.db import connection

pytestmark = pytest.mark.django_db(transaction=True)

SECONDS = float(os.environ.get("LLMGW_CONN_TEST_SECONDS", "20"))
CLIENTS = 8


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def connections_of(pid: int) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [f"llmgw pid {pid}"])
        return cursor.fetchone()[0]


# The default (docs/production.md, "Database connections"), and one set lower.
@pytest.mark.parametrize("pool_max, bound", [(None, 4), ("2", 2)])
def test_the_web_process_holds_no_more_connections_than_its_bound(web_factory, admin_token, pool_max, bound):
    if connection.vendor != "postgresql":
        pytest.skip("counts PostgreSQL connections")
    web = web_factory(**({} if pool_max is None else {"LLMGW_DB_POOL_MAX": pool_max}))
    paths = ["/api/v1/nodes/", "/api/v1/events/", "/api/v1/models/", "/api/v1/replicas/"]
    answers: dict[int, int] = {}
    failures: list[str] = []
    stop = threading.Event()

    def client(n: int) -> None:
        # A new connection every few requests, as browsers and scripts do.
        while not stop.is_set():
            with httpx.Client(base_url=web.url, timeout=30,
                              headers={"Authorization": f"Token {admin_token}"}) as http:
                for path in paths[n % len(paths):] + paths[: n % len(paths)]:
                    try:
                        status = http.get(path).status_code
                    except httpx.TransportError as exc:
                        failures.append(repr(exc))
                        continue
                    answers[status] = answers.get(status, 0) + 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    counts = []
    cpu_before, wall_before = cpu_seconds(web.proc.pid), time.monotonic()
    try:
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline:
            counts.append(connections_of(web.proc.pid))
            time.sleep(0.25)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    counts.append(connections_of(web.proc.pid))
    cpu, wall = cpu_seconds(web.proc.pid) - cpu_before, time.monotonic() - wall_before
    assert not failures, failures[:5]
    assert set(answers) == {200} and sum(answers.values()) > 100, answers
    print(f"web connections over {SECONDS:.0f}s, {sum(answers.values())} requests from {CLIENTS} clients: "
          f"max {max(counts)}, last {counts[-1]} (bound {bound}); {sum(answers.values()) / wall:.0f} requests/s, "
          f"{1000 * cpu / sum(answers.values()):.1f} ms of the web process's CPU per request (a shared machine)")
    assert max(counts) <= bound, counts
    assert min(counts) >= 1  # it did use the database
