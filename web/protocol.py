"""The web process's HTTP/1.1 protocol: uvicorn's httptools protocol with
bounds on the request head, enforced before anything reaches Django.

httptools (llhttp) sets no limit of its own: uvicorn read an 8 MiB header in
full before the application answered 401, and four connections holding
unfinished 32 MiB headers doubled the process's memory. A head here is
refused with 431 once it passes ``LLMGW_WEB_MAX_HEAD_BYTES`` (the agent API's
32 KiB; nginx and h11 stop at 8-16 KiB) or holds more than
``LLMGW_WEB_MAX_HEADERS`` headers, and a connection whose head has not arrived
whole ``LLMGW_WEB_HEAD_TIMEOUT`` seconds after it began (or after the
connection opened) is closed with 408. Bodies keep their own bounds (the
gateway's LLMGW_GATEWAY_BODY_TIMEOUT and LLMGW_GATEWAY_MAX_BODY_BYTES).

We keep httptools rather than switch to h11 (whose
``h11_max_incomplete_event_size`` bounds only the size): the gateway's
per-request CPU was measured with httptools, and h11 alone bounds neither the
number of headers nor the time they take.

Two things this protocol does for the gateway's speed (issue 20): a
response's writes made in one event-loop turn go out as one (``_Coalescing``),
the last of them as soon as the response is complete; and a request learns
that its client went away from a callback it registers through the scope
(``scope["extensions"]["llmgw.on_disconnect"]``, gateway.asgi) rather than
from a task of its own waiting on ``receive()``.

``llmgw up`` passes this class to uvicorn (``--http web.protocol:HttpProtocol``);
so must anyone who runs uvicorn directly (docs/production.md).
"""

from __future__ import annotations

import logging

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

logger = logging.getLogger(__name__)

# The scope extension through which an application registers a callback (or None, to stop watching) to be
# called once when its client goes away before its response is complete. gateway.asgi names it too
# (neither package imports the other); tests/gateway/test_disconnect.py holds the two names equal.
DISCONNECT_EXTENSION = "llmgw.on_disconnect"


class _DisconnectWatch:
    """What a connection's scopes offer as DISCONNECT_EXTENSION: it holds the running request's callback.
    Not a method of the protocol: a scope that pointed back at its protocol would make each connection a
    reference cycle, left to the garbage collector when it closes."""

    __slots__ = ("callback",)

    def __init__(self) -> None:
        self.callback = None

    def __call__(self, callback) -> None:
        """The running request's callback, or None when it stops watching (its answer is complete). One
        at a time: a pipelined request starts after the one before it ended."""
        self.callback = callback

    def fire(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


class HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a head already answered."""


class _Coalescing:
    """A response's writes, joined into one per event-loop turn.

    uvicorn writes a response's head and its body separately: two send
    calls, and on loopback each costs the kernel's delivery to the peer in
    this process's time (the largest part of a gateway request's CPU,
    bench/gateway_profile.py). Writes made in one turn go out as one, at the
    end of it; a close sends what is held first."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport, loop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = [data]
            self._loop.call_soon(self.flush)
        else:
            self._held.append(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class HttpProtocol(HttpToolsProtocol):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Read here, not at import: uvicorn imports this class before the app
        # (and so Django's settings) is loaded.
        self.max_head_bytes = settings.LLMGW_WEB_MAX_HEAD_BYTES
        self.max_headers = settings.LLMGW_WEB_MAX_HEADERS
        self.head_timeout = settings.LLMGW_WEB_HEAD_TIMEOUT
        self._awaiting_head = True
        self._head_bytes = 0  # bytes received while the head was unfinished
        self._heads_done = 0  # heads completed, so that a read knows whether one ended in it
        self._head_size = 0  # bytes of request target and headers parsed
        self._header_count = 0
        self._head_timer = None
        self._refused = False
        self._coalescing: _Coalescing | None = None
        self._running = None  # the request whose application runs (self.cycle may be one pipelined behind it)
        self._disconnect_watch = _DisconnectWatch()

    # --- the head's deadline ------------------------------------------------

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # an answer is still going out; the next head's first byte arms a new deadline
        if self._awaiting_head and not self.transport.is_closing():
            self._refuse(408, f"the request head did not arrive within {self.head_timeout:g} s")

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A connection that sends nothing is a head that never arrives.
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)
        running = self._running
        if running is not None and running is not self.cycle and not running.response_complete:
            # uvicorn tells only its newest request (a pipelined one waiting its turn), not the one running.
            running.disconnected = True
            running.message_event.set()
        self._running = None
        self._disconnect_watch.fire()

    def _start_asgi_task(self, cycle, app) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        # The response's last write goes out now, not a loop turn later: at concurrency 1 every request
        # waits for its own.
        self._flush()
        super().on_response_complete()

    # --- refusing -----------------------------------------------------------

    def _flush(self) -> None:
        """What a response held goes first, before the protocol writes or closes by itself."""
        if self._coalescing is not None:
            self._coalescing.flush()

    def shutdown(self) -> None:
        self._flush()
        super().shutdown()

    def _refuse(self, status: int, message: str) -> None:
        if self._refused:
            return
        self._flush()
        self._refused = True
        self._disarm_head_timer()
        client = "%s:%d" % self.client if self.client else "?"
        logger.warning("web request head refused client=%s status=%d: %s", client, status, message)
        body = message.encode("ascii", "replace")
        self.transport.write(b"".join([
            STATUS_LINE[status],
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]))
        self.transport.close()

    def _too_large(self) -> None:
        self._refuse(431, f"the request head is larger than {self.max_head_bytes} bytes")

    # --- reading ------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        counting = self._awaiting_head
        heads_before = self._heads_done
        if counting:
            # The first byte of a head on a kept-alive connection starts its deadline.
            self._arm_head_timer()
        try:
            super().data_received(data)
        except HeadRefused:  # pragma: no cover - httptools wraps it; kept for other parsers
            return
        if self._refused or not counting or not self._awaiting_head or self._heads_done != heads_before:
            # A head ended in this read (its request may even have completed,
            # body and all, leaving the parser awaiting the next head): these
            # bytes were not all head. A pipelined next head begun here is
            # counted from its next read on.
            return
        # Still inside the same head after this read: every byte so far was head.
        self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes:
            self._too_large()

    def send_400_response(self, msg: str) -> None:
        # A callback of ours stopped the parser after answering: uvicorn sees
        # a parser error, but the answer has been given already.
        if self._refused:
            return
        self._flush()
        super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_head = True
        self._head_size = self._header_count = 0

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        if self._head_size > self.max_head_bytes:
            self._too_large()
            raise HeadRefused
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        self._header_count += 1
        if self._head_size > self.max_head_bytes:
            self._too_large()
            raise HeadRefused
        if self._header_count > self.max_headers:
            self._refuse(431, f"the request has more than {self.max_headers} headers")
            raise HeadRefused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._heads_done += 1
        self._head_bytes = 0
        self._disarm_head_timer()
        super().on_headers_complete()
        if self.cycle is not None:
            if self._coalescing is None:
                self._coalescing = _Coalescing(self.transport, self.loop)
            self.cycle.transport = self._coalescing
            extensions = self.cycle.scope.setdefault("extensions", {})
            extensions[DISCONNECT_EXTENSION] = self._disconnect_watch

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # The next head's bytes are counted from here; its deadline starts
        # with its first byte (uvicorn's keep-alive timeout covers the wait).
        self._awaiting_head = True
        self._head_bytes = 0
