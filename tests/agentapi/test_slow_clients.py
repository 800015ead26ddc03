"""Hostile clients with a certificate the authority signed cannot silence the
agent API: requests are read whole in the event loop under a deadline, idle
connections are closed, a revoked certificate is refused right after its
handshake, and one certificate holds only a few connections.

Every test runs a real agent API (gunicorn, mTLS) against the test database.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import time
from collections import Counter

import httpx
import pytest
from agent.protocol import example_heartbeat
from nodes.choices import NodeStatus
from nodes.models import Node
from nodes.sweep import nodes_sweep_lost
from pki import services as pki_services
from tests.conftest import mtls_context
from tests.nodes.test_agent_api import heartbeat_url, payload, post, wait_for_log

pytestmark = pytest.mark.django_db(transaction=True)

SLOW_HEAD = b"POST /agent/v1/nodes/%s/heartbeat HTTP/1.1\r\nHost: agent-api\r\nContent-Type: application/json\r\n"


def tls_connect(server, creds, timeout: float = 5.0) -> ssl.SSLSocket:
    raw = socket.create_connection((server.host, server.port), timeout=timeout)
    return mtls_context(*creds).wrap_socket(raw, server_hostname=server.host)


def read_until_closed(sock: ssl.SSLSocket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    started = time.monotonic()
    sock.settimeout(timeout)
    received = b""
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                break
            received += data
    except (ConnectionResetError, ssl.SSLError):
        pass
    except TimeoutError:
        raise AssertionError(f"still open after {timeout}s; received {received[:200]!r}") from None
    return received, time.monotonic() - started


def read_response(sock: ssl.SSLSocket) -> bytes:
    """One whole response with a Content-Length (head and body may come in
    separate records), and nothing after it."""
    sock.settimeout(5)
    answer = b""
    while b"\r\n\r\n" not in answer:
        data = sock.recv(4096)
        assert data, f"closed after {answer!r}"
        answer += data
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        data = sock.recv(4096)
        assert data, f"closed after {answer!r}"
        body += data
    return head + b"\r\n\r\n" + body


def ping_over(sock: ssl.SSLSocket) -> bytes:
    sock.sendall(b"GET /agent/v1/ping HTTP/1.1\r\nHost: agent-api\r\n\r\n")
    return read_response(sock)


def test_a_request_trickling_in_is_closed_at_its_deadline(agent_api_factory, client_cert):
    server = agent_api_factory(LLMGW_AGENT_REQUEST_TIMEOUT="2", LLMGW_AGENT_IDLE_TIMEOUT="30")
    creds = client_cert("node01")
    sock = tls_connect(server, creds)
    try:
        started = time.monotonic()
        closed_at = None
        for byte in SLOW_HEAD % b"node01":
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            sock.settimeout(0.4)
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except (ConnectionResetError, ssl.SSLError):
                data = b""
            closed_at = time.monotonic() - started
            rest, _ = read_until_closed(sock, 5) if data else (b"", 0)
            answer = data + rest
            break
        assert closed_at is not None, "the server never gave up on a request sent a byte every 0.4 s"
        # Two seconds of deadline, checked once a second by the event loop.
        assert 1.5 < closed_at < 6, closed_at
        assert answer.startswith(b"HTTP/1.1 408 "), answer
    finally:
        sock.close()
    wait_for_log(server, "not whole after", "cn=node01")
    assert not Node.objects.exists()


def test_a_whole_request_sent_slowly_but_in_time_is_answered(agent_api_factory, client_cert):
    server = agent_api_factory(LLMGW_AGENT_REQUEST_TIMEOUT="10")
    body = json.dumps(payload()).encode()
    request = SLOW_HEAD % b"node01" + b"Content-Length: %d\r\n\r\n" % len(body) + body
    sock = tls_connect(server, client_cert("node01"))
    try:
        for i in range(0, len(request), len(request) // 8 + 1):
            sock.sendall(request[i : i + len(request) // 8 + 1])
            time.sleep(0.2)
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
    finally:
        sock.close()
    assert Node.objects.get(name="node01").gpus.count() == 8


def test_pipelined_requests_are_answered_each_in_turn(agent_api_factory, client_cert):
    server = agent_api_factory(LLMGW_AGENT_REQUEST_TIMEOUT="3")
    sock = tls_connect(server, client_cert("node01"))
    ping = b"GET /agent/v1/ping HTTP/1.1\r\nHost: agent-api\r\n\r\n"
    try:
        sock.sendall(ping + ping[:20])  # one whole request and the start of the next
        first = read_response(sock)
        assert first.startswith(b"HTTP/1.1 200 ") and first.count(b"HTTP/1.1") == 1, first
        sock.settimeout(0.5)  # nothing more until the second request is whole
        with pytest.raises(TimeoutError):
            sock.recv(4096)
        time.sleep(0.5)
        sock.sendall(ping[20:])
        second = read_response(sock)
        assert second.startswith(b"HTTP/1.1 200 "), second
    finally:
        sock.close()


@pytest.mark.parametrize("whole", [True, False], ids=["whole head", "head never ending"])
def test_a_request_head_over_32_kib_is_answered_431_and_closed(agent_api, client_cert, whole):
    """gunicorn alone would read up to ~800 KiB of headers (100 fields of
    8 KiB) in a thread; the event loop refuses past 32 KiB (framing.MAX_HEAD)."""
    sock = tls_connect(agent_api, client_cert("node01"))
    filler = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"a" * 4000) for i in range(9))  # about 36 KiB
    try:
        sock.sendall(b"GET /agent/v1/ping HTTP/1.1\r\nHost: agent-api\r\n" + filler + (b"\r\n" if whole else b""))
        received, _ = read_until_closed(sock, timeout=5)
    finally:
        sock.close()
    assert received.startswith(b"HTTP/1.1 431 "), received[:200]
    assert b"Connection: close" in received
    wait_for_log(agent_api, "refused a request", "431", "cn=node01")


def test_an_idle_connection_is_closed_after_the_idle_timeout(agent_api_factory, client_cert):
    server = agent_api_factory(LLMGW_AGENT_IDLE_TIMEOUT="2")
    creds = client_cert("node01")
    kept_alive = tls_connect(server, creds)
    never_asked = tls_connect(server, creds)
    try:
        assert ping_over(kept_alive).startswith(b"HTTP/1.1 200 ")
        received, elapsed = read_until_closed(kept_alive, timeout=8)
        assert received == b"" and 1.0 < elapsed < 6, (received, elapsed)
        received, _ = read_until_closed(never_asked, timeout=8)
        assert received == b""
    finally:
        kept_alive.close()
        never_asked.close()


def test_a_revoked_certificate_is_closed_before_any_request_is_read(agent_api_factory, client_cert):
    server = agent_api_factory(LLMGW_AGENT_IDLE_TIMEOUT="30")
    creds = client_cert("node01")
    pki_services.cert_revoke(target="node01", reason="test")
    time.sleep(1.5)  # the listener re-reads the revoked serials every LLMGW_REVOCATION_CACHE_SECONDS
    sock = tls_connect(server, creds)
    try:
        received, elapsed = read_until_closed(sock, timeout=5)
    finally:
        sock.close()
    assert received == b"" and elapsed < 3, (received, elapsed)
    log = wait_for_log(server, "refused connection", "revoked certificate cn=node01")
    assert "not whole after" not in log
    # A certificate issued again for the node is served.
    assert post(server, client_cert("node01"), "node01").status_code == 200


def test_one_certificate_holds_at_most_its_share_of_connections(agent_api_factory, client_cert):
    server = agent_api_factory(workers=1, LLMGW_AGENT_CONNECTIONS_PER_CERT="2")
    creds = client_cert("node01")
    held = [tls_connect(server, creds) for _ in range(2)]
    extra = None
    try:
        for sock in held:
            assert ping_over(sock).startswith(b"HTTP/1.1 200 ")
        extra = tls_connect(server, creds)
        received, elapsed = read_until_closed(extra, timeout=5)
        assert received == b"" and elapsed < 3, (received, elapsed)
        wait_for_log(server, "cn=node01", "already holds 2 connections")
        # Another node is not affected, and a slot given back is free again.
        assert post(server, client_cert("node02"), "node02").status_code == 200
        held.pop().close()
        time.sleep(0.5)
        again = tls_connect(server, creds)
        held.append(again)
        assert ping_over(again).startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in held + ([extra] if extra else []):
            sock.close()


# --- the scenario -------------------------------------------------------


class SlowClients:
    """``count`` connections per certificate sending a heartbeat's head one byte
    every ``interval`` seconds, reconnecting when the server closes them, in an
    event loop of their own."""

    def __init__(self, server, groups: dict[str, tuple[str, str, str]], count: int, interval: float) -> None:
        self.server = server
        self.groups = groups
        self.count = count
        self.interval = interval
        self.stats: dict[str, Counter] = {name: Counter() for name in groups}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> "SlowClients":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    async def _main(self) -> None:
        tasks = []
        for name, creds in self.groups.items():
            context = mtls_context(*creds)
            request = SLOW_HEAD % name.encode() + b"Content-Length: 100000\r\n\r\n" + b"{" * 100
            for i in range(self.count):
                tasks.append(asyncio.create_task(self._one(name, context, request, i * self.interval / self.count)))
        await asyncio.gather(*tasks)

    async def _one(self, name: str, context: ssl.SSLContext, request: bytes, delay: float) -> None:
        stats = self.stats[name]
        await asyncio.sleep(delay)
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.server.host, self.server.port, ssl=context,
                                            server_hostname=self.server.host),
                    timeout=10,
                )
            except (OSError, asyncio.TimeoutError):
                stats["connect failed"] += 1
                await asyncio.sleep(self.interval)
                continue
            stats["connected"] += 1
            try:
                for byte in request:
                    if self._stop.is_set():
                        break
                    writer.write(bytes([byte]))
                    await writer.drain()
                    stats["bytes sent"] += 1
                    try:
                        data = await asyncio.wait_for(reader.read(4096), timeout=self.interval)
                    except asyncio.TimeoutError:
                        continue
                    if data:
                        stats["answered " + data[:12].decode(errors="replace")] += 1
                    else:
                        stats["closed unanswered"] += 1
                    break
            except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
                stats["closed unanswered"] += 1
            finally:
                writer.close()
            await asyncio.sleep(self.interval)


def test_200_slow_connections_with_a_valid_and_a_revoked_certificate_silence_no_node(
    agent_api_factory, client_cert, settings
):
    """The issue's reproduction: 64 such connections made a healthy node lost.
    With production's workers and threads, 100 slow connections with a valid
    certificate and 100 with a revoked one, for longer than the request
    deadline, while four other nodes heartbeat with a 1 s client timeout and
    the lost-node sweep runs with a 3 s grace."""
    server = agent_api_factory(workers=2, threads=16, LLMGW_AGENT_REQUEST_TIMEOUT="3")
    healthy = {f"node{i:02d}": client_cert(f"node{i:02d}") for i in range(1, 5)}
    slow = {"attacker": client_cert("attacker"), "revoked": client_cert("revoked")}
    pki_services.cert_revoke(target="revoked", reason="test")
    settings.LLMGW_NODE_GRACE = 3.0
    settings.LLMGW_MASS_SILENCE_FRACTION = 1.0  # a single starved node is declared lost, not held

    inventory = example_heartbeat(gpus=0).to_dict()  # GPU uuids are unique across nodes
    clients = {name: httpx.Client(verify=mtls_context(*creds), timeout=1.0) for name, creds in healthy.items()}
    failures: list[str] = []
    lost: list[str] = []
    answered = 0
    try:
        for name, client in clients.items():  # register: the first heartbeat writes the inventory
            r = client.post(heartbeat_url(server, name), json=inventory, timeout=10)
            assert r.status_code == 200, r.text
        time.sleep(1.5)  # the listener's copy of the revoked serials
        with SlowClients(server, slow, count=100, interval=1.0) as attack:
            ends = time.monotonic() + 12  # four request deadlines
            while time.monotonic() < ends:
                for name, client in clients.items():
                    started = time.monotonic()
                    try:
                        r = client.post(heartbeat_url(server, name), json=inventory)
                        if r.status_code == 200:
                            answered += 1
                        else:
                            failures.append(f"{name}: {r.status_code} {r.text[:200]}")
                    except httpx.HTTPError as exc:
                        failures.append(f"{name}: {type(exc).__name__} after {time.monotonic() - started:.2f}s")
                lost += nodes_sweep_lost()
                time.sleep(0.4)
    finally:
        for client in clients.values():
            client.close()

    stats = attack.stats
    assert answered > 0 and not failures, (failures, answered, stats)
    assert not lost and not Node.objects.filter(status=NodeStatus.LOST).exists(), lost
    assert set(Node.objects.values_list("name", flat=True)) == set(healthy)
    # The attack was real: every connection opened at least once and sent bytes.
    assert stats["attacker"]["connected"] >= 100 and stats["revoked"]["connected"] >= 100, stats
    # A revoked certificate never got a byte of HTTP back: closed after its handshake.
    assert not any(key.startswith("answered") for key in stats["revoked"]), stats["revoked"]
    # The valid certificate held a few connections until their deadline (408);
    # the rest were refused by the per-certificate cap.
    assert stats["attacker"]["answered HTTP/1.1 408"] > 0, stats["attacker"]
    log = wait_for_log(server, "revoked certificate cn=revoked", "cn=attacker", "already holds 4 connections")
    assert "not whole after" in log
