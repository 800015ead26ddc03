"""A small, cheap HTTP/1.1 load generator on raw asyncio streams.

Keep-alive connections, one per worker; Content-Length and chunked bodies;
for streamed completions the time to the first token (the first SSE event
carrying non-empty content) and whether the stream ended with ``[DONE]``.
It spends a few tens of microseconds of CPU per request, so that on a
shared two-core machine the proxies, not the client, are what is measured.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

_FIRST_TOKEN = re.compile(rb'"(?:content|text)":\s*"[^"]')


@dataclass
class Sample:
    ok: bool
    latency: float
    ttft: float | None = None
    error: str = ""


@dataclass
class Phase:
    samples: list[Sample] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def good(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def errors(self) -> list[Sample]:
        return [s for s in self.samples if not s.ok]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def request(self, raw: bytes, stream: bool) -> Sample:
        started = time.perf_counter()
        try:
            if self.writer is None:
                await self.open()
            self.writer.write(raw)
            head = await self.reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            headers = head.lower()
            keep_alive = b"connection: close" not in headers
            ttft = None
            if b"transfer-encoding: chunked" in headers:
                body, ttft = await self._chunked(started, stream)
            else:
                match = re.search(rb"content-length:\s*(\d+)", headers)
                body = await self.reader.readexactly(int(match.group(1))) if match else await self.reader.read()
                keep_alive = keep_alive and match is not None
            latency = time.perf_counter() - started
            if not keep_alive:
                self.close()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            self.close()
            return Sample(False, time.perf_counter() - started, error=type(exc).__name__)
        if status != 200:
            return Sample(False, latency, error=f"HTTP {status}")
        if stream:
            if not body.rstrip().endswith(b"data: [DONE]"):
                return Sample(False, latency, ttft, error="stream cut short")
            if ttft is None:
                return Sample(False, latency, error="no token in stream")
        elif b'"choices"' not in body:
            return Sample(False, latency, error="no choices")
        return Sample(True, latency, ttft)

    async def _chunked(self, started: float, stream: bool) -> tuple[bytes, float | None]:
        parts, ttft, tail = [], None, b""
        while True:
            size_line = await self.reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                return b"".join(parts), ttft
            chunk = data[:-2]
            if stream and ttft is None:
                window = tail + chunk
                if _FIRST_TOKEN.search(window):
                    ttft = time.perf_counter() - started
                tail = window[-64:]
            parts.append(chunk)


def build_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def run_phase(host: str, port: int, raw: bytes, *, stream: bool, concurrency: int, max_requests: int,
                    max_seconds: float) -> Phase:
    phase = Phase()
    remaining = max_requests
    deadline = time.perf_counter() + max_seconds

    async def worker() -> None:
        nonlocal remaining
        connection = Connection(host, port)
        try:
            while remaining > 0 and time.perf_counter() < deadline:
                remaining -= 1
                phase.samples.append(await connection.request(raw, stream))
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    phase.elapsed = time.perf_counter() - started
    return phase
