"""The gateway's client to engines (gateway.upstream) against real sockets on
127.0.0.1: servers written here byte by byte, so that each way an engine can
answer, stall, close or misbehave is the one the test names."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway import upstream
from gateway.upstream import Broken, ConnectTimeout, Disconnected, NoConnection, Pool

HOST = "127.0.0.1"
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class Server:
    """An asyncio server whose handler gets each request's raw head and body; counts connections."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server = None

    async def __aenter__(self) -> "Server":
        self.server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if await self.handler(head, body, reader, writer) == "close":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went
        finally:
            writer.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def answer_ok(head, body, reader, writer):
    writer.write(OK)
    await writer.drain()


def test_a_post_is_one_write_and_its_connection_is_kept_for_the_next():
    async def scenario():
        async with Server(answer_ok) as server:
            pool = Pool()
            for _ in range(3):
                response = await pool.post(HOST, server.port, "/v1/chat/completions", b'{"a":1}', connect_timeout=2)
                assert (response.status, response.content_type, await response.read()) == (200, "application/json",
                                                                                            b"{}")
                response.release()
            pool.close()
            return server

    server = run(scenario())
    assert server.connections == 1
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert f"Host: {HOST}:".encode() in head and b"Content-Length: 7" in head and body == b'{"a":1}'


def test_an_answer_that_says_close_is_not_kept_and_one_closed_while_idle_is_not_reused():
    async def close_after(head, body, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        return "close"

    async def scenario():
        async with Server(close_after) as server:
            pool = Pool()
            for _ in range(2):
                response = await pool.post(HOST, server.port, "/x", b"{}", connect_timeout=2)
                assert await response.read() == b"{}"
                response.release()
                await asyncio.sleep(0.05)
            assert pool.open_connections == 0
            return server.connections

    assert run(scenario()) == 2


def test_an_engine_that_closes_idle_connections_costs_no_request():
    async def close_quietly(head, body, reader, writer):
        writer.write(OK)  # keep-alive by its headers, then gone (an engine's idle timeout)
        await writer.drain()
        return "close"

    async def scenario():
        async with Server(close_quietly) as server:
            pool = Pool()
            for _ in range(3):
                response = await pool.post(HOST, server.port, "/x", b"{}", connect_timeout=2)
                assert await response.read() == b"{}"
                response.release()
                await asyncio.sleep(0.05)  # the close reaches the pool before the next request
            return server.connections

    assert run(scenario()) == 3


def test_refused_is_no_connection():
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]  # bound, not listening: refused

        async def scenario():
            pool = Pool()
            with pytest.raises(NoConnection, match="cannot connect"):
                await pool.post(HOST, port, "/x", b"{}", connect_timeout=2)
            return pool.open_connections

        assert run(scenario()) == 0


def test_a_connect_that_does_not_complete_is_a_connect_timeout():
    # A listener whose accept queue is full and never drained: the kernel drops further SYNs.
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex((HOST, port))
            fillers.append(filler)

        async def scenario():
            pool = Pool()
            with pytest.raises(ConnectTimeout, match="within 0.3s"):
                await pool.post(HOST, port, "/x", b"{}", connect_timeout=0.3)
            return pool.open_connections

        assert run(scenario()) == 0
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def test_closed_before_answering_is_disconnected_and_mid_answer_is_broken():
    async def no_answer(head, body, reader, writer):
        return "close"

    async def half_answer(head, body, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await writer.drain()
        return "close"

    async def endless_head(head, body, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nX-Filler: ")
        for _ in range(200):  # 1.6 MB of one header's value, never ended
            writer.write(b"x" * 8192)
            await writer.drain()
        await reader.read()

    async def not_http(head, body, reader, writer):
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()

    async def scenario():
        pool = Pool()
        async with Server(no_answer) as server:
            with pytest.raises(Disconnected, match="before answering"):
                await pool.post(HOST, server.port, "/x", b"{}", connect_timeout=2)
        async with Server(half_answer) as server:
            response = await pool.post(HOST, server.port, "/x", b"{}", connect_timeout=2)
            with pytest.raises(Broken, match="mid-answer"):
                await response.read()
            response.close()
        async with Server(endless_head) as server:
            with pytest.raises(Broken, match="head is larger than 64 KiB"):
                await pool.post(HOST, server.port, "/x", b"{}", connect_timeout=2)
        async with Server(not_http) as server:
            with pytest.raises(Broken, match="not valid HTTP"):
                await pool.post(HOST, server.port, "/x", b"{}", connect_timeout=2)
        await asyncio.sleep(0.05)
        return pool.open_connections

    assert run(scenario()) == 0


def test_a_body_without_a_length_ends_at_the_close():
    async def old_style(head, body, reader, writer):
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"old\": true}")
        await writer.drain()
        return "close"

    async def scenario():
        async with Server(old_style) as server:
            pool = Pool()
            response = await pool.post(HOST, server.port, "/x", b"{}", connect_timeout=2)
            assert await response.read() == b'{"old": true}'
            response.release()
            await asyncio.sleep(0.05)
            return pool.open_connections  # not kept: it ended with its connection

    assert run(scenario()) == 0


def test_a_stream_is_read_as_it_comes_and_a_slow_reader_pauses_the_engine():
    chunk = b"x" * 65536
    count = 32  # 2 MiB: far beyond the pool's high-water mark

    async def stream(head, body, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(count):
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def scenario():
        async with Server(stream) as server:
            pool = Pool()
            response = await pool.post(HOST, server.port, "/x", b"{}", connect_timeout=2)
            assert response.content_type == "text/event-stream"
            await asyncio.sleep(0.3)  # nobody reads: the engine's socket is paused, not drained into memory
            conn = response._conn
            # Held here: at most the high-water mark and the one socket read that crossed it (256 KiB at most).
            assert conn.paused and response._buffered <= upstream.HIGH_WATER + 256 * 1024
            received = 0
            while data := await response.readany():
                received += len(data)
            assert received == count * len(chunk) and response.complete
            response.release()
            assert pool.open_connections == 1  # kept for the next request
            pool.close()

    run(scenario())


def test_the_limit_makes_requests_wait_for_a_connection():
    async def scenario():
        gate = asyncio.Event()

        async def slow(head, body, reader, writer):
            await gate.wait()
            writer.write(OK)
            await writer.drain()

        async with Server(slow) as server:
            pool = Pool(limit=1)
            first = asyncio.ensure_future(pool.post(HOST, server.port, "/x", b"{}", connect_timeout=2))
            second = asyncio.ensure_future(pool.post(HOST, server.port, "/x", b"{}", connect_timeout=2))
            await asyncio.sleep(0.2)
            assert len(server.requests) == 1 and pool.open_connections == 1  # the second waits for the first's
            gate.set()
            response = await first
            assert await response.read() == b"{}"
            response.release()
            response = await second
            assert await response.read() == b"{}"
            response.release()
            assert server.connections == 1
            pool.close()

    run(scenario())


def test_at_the_limit_an_idle_connection_to_another_engine_makes_room():
    async def scenario():
        async with Server(answer_ok) as one, Server(answer_ok) as two:
            pool = Pool(limit=1)
            response = await pool.post(HOST, one.port, "/x", b"{}", connect_timeout=2)
            await response.read()
            response.release()  # idle, to engine one
            response = await asyncio.wait_for(pool.post(HOST, two.port, "/x", b"{}", connect_timeout=2), 5)
            assert await response.read() == b"{}"
            response.release()
            assert pool.open_connections == 1 and (one.connections, two.connections) == (1, 1)
            pool.close()

    run(scenario())


def test_a_request_cancelled_while_waiting_for_its_answer_closes_its_connection():
    async def scenario():
        gone = asyncio.Event()

        async def never(head, body, reader, writer):
            await reader.read()  # nothing comes but the end: the client went
            gone.set()
            return "close"

        async with Server(never) as server:
            pool = Pool()
            task = asyncio.ensure_future(pool.post(HOST, server.port, "/x", b"{}", connect_timeout=2))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(gone.wait(), 5)  # the engine sees the client go
            await asyncio.sleep(0.05)
            return pool.open_connections

    assert run(scenario()) == 0
