"""The gateway's HTTP/1.1 client to engines: keep-alive connections per
replica, one write per request, httptools (llhttp, the parser uvicorn uses
for the gateway's own server side) to read the answers.

aiohttp's client did this before and cost more than anything else on a
plain request's path (``bench/gateway_profile.py``: its request object,
connector, tracing hooks, cookie and header machinery, its stream reader and
payload writer: about a third of the web process's Python time per request).
The gateway needs little of it: one method (POST), one body already in
memory, plain HTTP to addresses it knows, no redirects, cookies, proxies or
compression. What it needs is here: a pool bounded like aiohttp's
(``LLMGW_GATEWAY_MAX_CONNECTIONS``, idle connections closed after
``KEEPALIVE``), a connect timeout, an answer read whole or chunk by chunk
with back-pressure (a slow client pauses the engine's socket, not the
gateway's memory), and failures told apart the way forwarding needs them:

- ``NoConnection``: no connection could be opened (refused, unreachable);
- ``ConnectTimeout``: nor within the model's connect timeout;
- ``Disconnected``: the connection went before the answer's first byte (a
  pooled connection the engine had closed: the same replica may take the
  request again on a new one);
- ``Broken``: the answer broke off, was not HTTP, or its head passed
  ``MAX_HEAD`` (an engine's head is a few hundred bytes; a node sending an
  endless one does not fill the gateway's memory).

aiohttp stays the client for everything else (engines' /metrics).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque

import httptools

KEEPALIVE = 30.0  # seconds an idle connection is kept (aiohttp's default was ours)
SWEEP_EVERY = 10.0
# A streamed answer's bytes buffered here beyond this pause the engine's socket until the client took them.
HIGH_WATER = 256 * 1024
# An answer's head (status line and headers) larger than this is refused as broken: httptools holds a header
# whole until it ends, and an engine's head is a few hundred bytes (aiohttp's bound was 8 KiB a line).
MAX_HEAD = 64 * 1024


class UpstreamError(Exception):
    """A failed exchange with an engine."""


class NoConnection(UpstreamError):
    pass


class ConnectTimeout(UpstreamError):
    pass


class Disconnected(UpstreamError):
    pass


class Broken(UpstreamError):
    pass


class Response:
    """An engine's answer: its status and content type once its head arrived, its body as it comes."""

    __slots__ = ("status", "content_type", "_conn", "_chunks", "_buffered", "_waiter", "_error", "complete",
                 "_keep_alive", "_done", "_whole", "framed")

    def __init__(self, conn: "_Connection") -> None:
        self.status = 0
        self.content_type: str | None = None
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self.complete = False
        self._keep_alive = False
        self._done = False  # released or closed: the connection is no longer this answer's
        self._whole = False  # read whole (read()): no back-pressure, the body is wanted in memory
        self.framed = False  # a length or chunked encoding said where the body ends (else: at the close)

    # --- fed by the connection ----------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self._wake()

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._whole:
            self._conn.pause()
        self._wake()

    async def _wait(self) -> None:
        waiter = self._waiter = self._conn.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    # --- read by the gateway --------------------------------------------------------------

    async def readany(self) -> bytes:
        """What has arrived of the body since the last read (waiting for some), b"" at its end."""
        while not self._chunks:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True
        self._conn.resume()
        while not self.complete:
            if self._error is not None:
                raise self._error
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool when the answer ended cleanly."""
        if self._done:
            return
        self._done = True
        conn = self._conn
        conn.response = None
        if self.complete and self._keep_alive and not conn.closed:
            conn.resume()  # (paused by an end that came faster than it was read)
            conn.pool._put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Drop the connection (the engine sees it go, and stops generating)."""
        if self._done:
            return
        self._done = True
        self._conn.response = None
        self._conn.close()


class _Connection(asyncio.Protocol):
    __slots__ = ("pool", "key", "loop", "transport", "parser", "response", "closed", "idle_since", "paused",
                 "served", "_lost", "head_bytes")

    def __init__(self, pool: "Pool", key: tuple[str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.pool, self.key, self.loop = pool, key, loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self.paused = False
        self.served = 0  # answers read on this connection
        self._lost = False
        self.head_bytes = 0  # bytes received of the current answer before its head ended

    # --- asyncio ------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            self.close()  # bytes nobody asked for: the connection is not fit to reuse
            return
        if not response.status:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._fail(Broken(f"the engine's answer is not valid HTTP ({exc})"))
            self.close()
            return
        if not response.status and self.head_bytes > MAX_HEAD:
            response._fail(Broken(f"the engine's answer head is larger than {MAX_HEAD // 1024} KiB"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._lost = True
        response = self.response
        if response is not None and not response.complete:
            if response.status and not response.framed:
                response.complete = True  # a body without a length ends where the connection does (HTTP/1.0)
                response._wake()
            elif response.status:
                response._fail(Broken(f"the engine closed the connection mid-answer ({exc or 'closed'})"))
            else:
                response._fail(Disconnected(f"the engine closed the connection before answering ({exc or 'closed'})"))
        self.pool._gone(self)

    # --- httptools --------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name)
        if size == 12 and name.lower() == b"content-type":
            self.response.content_type = value.decode("latin-1")
        elif (size == 14 and name.lower() == b"content-length") or (size == 17 and name.lower() == b"transfer-encoding"):
            self.response.framed = True

    def on_headers_complete(self) -> None:
        response = self.response
        response.status = self.parser.get_status_code()
        response._wake()

    def on_body(self, body: bytes) -> None:
        self.response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        response.complete = True
        response._keep_alive = self.parser.should_keep_alive()
        self.served += 1
        response._wake()

    # --- ours -----------------------------------------------------------------------------

    def pause(self) -> None:
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()


class Pool:
    """Keep-alive connections to engines, per (host, port), at most ``limit`` open in all (0: no limit)."""

    def __init__(self, *, limit: int = 0, keepalive: float = KEEPALIVE) -> None:
        self.limit = limit
        self.keepalive = keepalive
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._swept = time.monotonic()
        self._heads: dict[tuple[str, int, str], bytes] = {}

    @property
    def open_connections(self) -> int:
        return self._open

    async def post(self, host: str, port: int, path: str, body: bytes, *, connect_timeout: float | None,
                   content_type: bytes = b"application/json") -> Response:
        """Send a POST and return the answer once its head has arrived."""
        head = self._heads.get((host, port, path))
        if head is None:
            authority = f"[{host}]" if ":" in host else host
            head = (f"POST {path} HTTP/1.1\r\nHost: {authority}:{port}\r\n".encode("latin-1")
                    + b"Content-Type: " + content_type + b"\r\nContent-Length: ")
            if len(self._heads) < 4096:
                self._heads[(host, port, path)] = head
        conn = await self._acquire((host, port), connect_timeout)
        response = conn.response = Response(conn)
        conn.head_bytes = 0
        try:
            conn.transport.write(b"".join((head, str(len(body)).encode(), b"\r\n\r\n", body)))
            while not response.status:
                if response._error is not None:
                    raise response._error
                await response._wait()
        except BaseException:
            response.close()
            raise
        return response

    async def _acquire(self, key: tuple[str, int], connect_timeout: float | None) -> _Connection:
        conn = self._reuse(key)
        while conn is None and self.limit and self._open >= self.limit:
            self._close_idle_elsewhere(key)  # at the limit, an idle connection to another engine makes room
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            conn = self._reuse(key)
        return conn if conn is not None else await self._connect(key, connect_timeout)

    def _reuse(self, key: tuple[str, int]) -> _Connection | None:
        """An idle connection to the engine: the most recently used, the least likely to have been closed."""
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self, key: tuple[str, int], connect_timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        self._open += 1
        try:
            async with asyncio.timeout(connect_timeout or None):
                _, conn = await loop.create_connection(lambda: _Connection(self, key, loop), key[0], key[1])
        except TimeoutError:
            self._open -= 1
            self._wake_one()
            raise ConnectTimeout(f"no connection to {key[0]}:{key[1]} within {connect_timeout:g}s") from None
        except OSError as exc:
            self._open -= 1
            self._wake_one()
            raise NoConnection(f"cannot connect to {key[0]}:{key[1]}: {exc.strerror or exc}") from None
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise
        return conn

    def _put(self, conn: _Connection) -> None:
        now = time.monotonic()
        conn.idle_since = now
        self._idle.setdefault(conn.key, []).append(conn)
        self._wake_one()
        if now - self._swept > SWEEP_EVERY:
            self._sweep(now)

    def _gone(self, conn: _Connection) -> None:
        self._open -= 1
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        self._wake_one()

    def _close_idle_elsewhere(self, key: tuple[str, int]) -> None:
        """Close the longest idle connection to another engine (its close wakes a waiter)."""
        oldest = None
        for other, idle in self._idle.items():
            if other != key:
                for conn in idle:
                    if not conn.closed and (oldest is None or conn.idle_since < oldest.idle_since):
                        oldest = conn
        if oldest is not None:
            self._idle[oldest.key].remove(oldest)
            oldest.close()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _sweep(self, now: float) -> None:
        """Close connections idle longer than the keep-alive."""
        self._swept = now
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if not c.closed and now - c.idle_since <= self.keepalive]
            for conn in idle:
                if conn not in keep:
                    conn.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
