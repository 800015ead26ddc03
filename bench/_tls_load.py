"""A cheap mTLS load generator for the agent API.

One asyncio event loop (uvloop when installed), one ``SSLContext`` per
simulated node because each presents its own certificate, one kept-alive
connection per node, request bytes built once, responses framed by
``Content-Length``. No HTTP library: httpx spends about 1.4 ms of client CPU
per request, more than the server we are measuring, on a machine whose two
cores the load generator shares with it.

Each node has at most one request in flight, as a real agent does.
"""

from __future__ import annotations

import asyncio
import random
import ssl
import time
from array import array
from dataclasses import dataclass, field

_CRLF2 = b"\r\n\r\n"
NOT_FAILURES = {"reconnected", "retried"}


class HttpError(Exception):
    pass


def _dechunk(buf: bytearray, pos: int) -> tuple[bytes, int] | None:
    """(body, end) of a complete chunked body starting at ``pos``, or None if more is to come."""
    parts = []
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:
            # No trailers from our server: the body ends with an empty line.
            if len(buf) < pos + 2:
                return None
            return b"".join(parts), pos + 2
        if len(buf) < pos + size + 2:
            return None
        parts.append(bytes(buf[pos : pos + size]))
        pos += size + 2


class HttpConn(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.lost: BaseException | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.lost = exc or ConnectionResetError("connection closed by the server")
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(self.lost)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is not None:
            self._complete()

    def _complete(self) -> None:
        buf = self.buf
        end = buf.find(_CRLF2)
        if end < 0:
            return
        head = bytes(buf[:end]).lower()
        at = head.find(b"\r\ncontent-length:")
        if at >= 0:
            stop = head.find(b"\r\n", at + 2)
            length = int(head[at + 17 : stop if stop > 0 else len(head)])
            total = end + 4 + length
            if len(buf) < total:
                return
            body = bytes(buf[end + 4 : total])
        elif b"\r\ntransfer-encoding: chunked" in head:
            parsed = _dechunk(buf, end + 4)
            if parsed is None:
                return
            body, total = parsed
        else:
            self._fail(HttpError(f"response without a length: {head[:200]!r}"))
            return
        status = int(head[9:12])
        del buf[:total]
        waiter, self.waiter = self.waiter, None
        waiter.set_result((status, body))

    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def request(self, data: bytes) -> asyncio.Future:
        if self.lost is not None:
            raise self.lost
        fut = self.loop.create_future()
        self.waiter = fut
        self.transport.write(data)
        return fut


@dataclass
class SimNode:
    name: str
    context: ssl.SSLContext
    heartbeat: bytes  # the whole request
    ping: bytes
    conn: HttpConn | None = None


def client_context(*, cert: str, key: str, ca_pem: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=ca_pem)
    context.load_cert_chain(cert, key)
    return context


def post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()


@dataclass
class PhaseResult:
    name: str
    seconds: float = 0.0
    latencies: array = field(default_factory=lambda: array("d"))  # seconds
    sent_at: array = field(default_factory=lambda: array("d"))  # perf_counter at send, same order
    errors: dict[str, int] = field(default_factory=dict)
    late: int = 0  # paced sends that left after their slot (the generator or the server fell behind)
    max_lag: float = 0.0

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    @property
    def failures(self) -> int:
        """Requests that got no good answer (a reconnection or a retry that then succeeded is not one)."""
        return sum(n for what, n in self.errors.items() if what not in NOT_FAILURES)

    @property
    def ok(self) -> int:
        return len(self.latencies)

    @property
    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    def timeline(self, step: float = 1.0) -> list[tuple[float, int, float, float]]:
        """(offset s, requests, p99, max) per ``step`` seconds of sends: are slow answers spread or bunched?"""
        if not self.sent_at:
            return []
        start = min(self.sent_at)
        buckets: dict[int, list[float]] = {}
        for at, latency in zip(self.sent_at, self.latencies):
            buckets.setdefault(int((at - start) / step), []).append(latency)
        rows = []
        for k in sorted(buckets):
            ordered = sorted(buckets[k])
            rows.append((k * step, len(ordered), ordered[int(0.99 * (len(ordered) - 1))], ordered[-1]))
        return rows

    def percentile(self, p: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(p / 100.0 * len(ordered)))]


class LoadGenerator:
    def __init__(self, *, host: str, port: int, server_hostname: str = "localhost") -> None:
        self.host = host
        self.port = port
        self.server_hostname = server_hostname
        self.loop = asyncio.get_event_loop()

    async def connect(self, node: SimNode, timeout: float = 30.0) -> None:
        _, conn = await asyncio.wait_for(
            self.loop.create_connection(
                lambda: HttpConn(self.loop),
                self.host,
                self.port,
                ssl=node.context,
                server_hostname=self.server_hostname,
                ssl_handshake_timeout=timeout,
            ),
            timeout,
        )
        node.conn = conn

    async def connect_all(self, nodes: list[SimNode], *, concurrency: int) -> PhaseResult:
        """Open every node's connection (the TLS handshakes of a reconnect storm)."""
        result = PhaseResult("connect")
        queue = list(nodes)
        started = time.perf_counter()

        async def opener() -> None:
            while queue:
                node = queue.pop()
                t0 = time.perf_counter()
                try:
                    await self.connect(node)
                except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
                    result.error(type(exc).__name__)
                    continue
                result.latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(opener() for _ in range(min(concurrency, len(nodes)))))
        result.seconds = time.perf_counter() - started
        return result

    async def _one(self, node: SimNode, data: bytes, result: PhaseResult, expect: int = 200) -> bytes | None:
        t0 = time.perf_counter()
        for attempt in (1, 2):
            conn = node.conn
            try:
                if conn is None or conn.lost is not None:
                    await self.connect(node)  # as an agent would; counted in this request's latency
                    result.error("reconnected")
                    conn = node.conn
                status, body = await conn.request(data)
                break
            except ConnectionResetError:
                # The server closed a kept-alive connection as we reused it
                # (its keep-alive timeout): retry once on a new one, as HTTP
                # clients do for a request that is safe to repeat.
                node.conn = None
                if attempt == 2:
                    result.error("ConnectionResetError")
                    return None
                result.error("retried")
            except (OSError, asyncio.TimeoutError, ssl.SSLError, HttpError) as exc:
                result.error(type(exc).__name__)
                node.conn = None
                return None
        if status != expect:
            result.error(f"http {status}")
            return body
        result.latencies.append(time.perf_counter() - t0)
        result.sent_at.append(t0)
        return body

    async def closed_loop(
        self, nodes: list[SimNode], *, kind: str, concurrency: int, seconds: float | None = None,
        once: bool = False, name: str | None = None, check=None,
    ) -> PhaseResult:
        """``concurrency`` requests in flight, each lane walking its own share of
        the nodes; once=True sends exactly one request per node."""
        result = PhaseResult(name or f"{kind} closed-loop c={concurrency}")
        lanes = max(1, min(concurrency, len(nodes)))
        started = time.perf_counter()
        deadline = started + (seconds or 0.0)

        async def lane(share: list[SimNode]) -> None:
            while True:
                for node in share:
                    if not once and time.perf_counter() >= deadline:
                        return
                    body = await self._one(node, getattr(node, kind), result)
                    if check is not None and body is not None:
                        check(node, body, result)
                if once:
                    return

        await asyncio.gather(*(lane(nodes[i::lanes]) for i in range(lanes)))
        result.seconds = time.perf_counter() - started
        return result

    async def paced(self, nodes: list[SimNode], *, kind: str, rate: float, seconds: float) -> PhaseResult:
        """Open loop: every node sends every ``len(nodes)/rate`` seconds, the
        nodes' slots spread evenly, as a cluster of agents on timers does.
        A node whose previous request has not come back sends late."""
        result = PhaseResult(f"{kind} @ {rate:g}/s")
        interval = len(nodes) / rate
        started = time.perf_counter() + 0.05
        end = started + seconds
        order = list(range(len(nodes)))
        random.Random(1).shuffle(order)

        async def node_loop(node: SimNode, first: float) -> None:
            slot = first
            data = getattr(node, kind)
            while slot < end:
                now = time.perf_counter()
                if slot > now:
                    await asyncio.sleep(slot - now)
                else:
                    lag = now - slot
                    if lag > 0.01:
                        result.late += 1
                    result.max_lag = max(result.max_lag, lag)
                await self._one(node, data, result)
                slot += interval

        await asyncio.gather(
            *(node_loop(node, started + order[i] / rate) for i, node in enumerate(nodes))
        )
        result.seconds = seconds
        return result


async def hold_idle_connections(host: str, port: int, count: int, stop: asyncio.Event) -> dict[str, int]:
    """``count`` TCP connections that never start TLS (a port scanner, a stalled
    agent). Each one the server drops is opened again until ``stop``."""
    stats = {"opened": 0, "dropped_by_server": 0}

    async def holder() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            stats["opened"] += 1
            read = asyncio.ensure_future(reader.read(1))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if read.done():
                stats["dropped_by_server"] += 1
            for task in (read, stopped):
                task.cancel()
            writer.close()

    tasks = [asyncio.ensure_future(holder()) for _ in range(count)]
    await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)
    return stats


async def hold_slow_connections(
    host: str, port: int, context: ssl.SSLContext, request: bytes, count: int, interval: float, stop: asyncio.Event
) -> dict[str, int]:
    """``count`` mTLS connections with one node's certificate, each sending
    ``request`` one byte every ``interval`` seconds (a slow-loris), opened
    again whenever the server closes them, until ``stop``."""
    stats = {"opened": 0, "closed_by_server": 0, "answered_408": 0}

    async def sender() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port, ssl=context, server_hostname="localhost"), timeout=10
                )
            except (OSError, asyncio.TimeoutError):
                await asyncio.sleep(interval)
                continue
            stats["opened"] += 1
            try:
                for byte in request:
                    if stop.is_set():
                        break
                    writer.write(bytes([byte]))
                    await writer.drain()
                    try:
                        data = await asyncio.wait_for(reader.read(64), timeout=interval)
                    except asyncio.TimeoutError:
                        continue
                    stats["closed_by_server"] += 1
                    stats["answered_408"] += data.startswith(b"HTTP/1.1 408")
                    break
            except (OSError, ssl.SSLError):
                stats["closed_by_server"] += 1
            finally:
                writer.close()
            if not stop.is_set():
                await asyncio.sleep(interval)

    tasks = [asyncio.ensure_future(sender()) for _ in range(count)]
    await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)
    return stats
