"""Forwarding one request to a replica's leader and its answer back.

Non-streamed answers are read whole and sent with their length; streamed ones
are passed on chunk by chunk as the engine writes them, through a
StreamingHttpResponse over an async iterator (never a sync one: Django would
buffer it). A client that goes away cancels the task, and closing the
upstream response closes its connection: the engine sees the disconnect and
stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import AsyncIterator

from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse

from .bodycheck import ask_for_usage, encode  # noqa: F401 - callers import them from here
from .choices import ErrorKind
from .errors import json_response, openai_error, sse_error
from .routing import NO_HINTS, Hints, Route
from .runtime import Gateway
from .timeouts import Timeouts
from .upstream import Broken, ConnectTimeout, Disconnected, NoConnection, Response as UpstreamResponse

logger = logging.getLogger(__name__)

_USAGE_OBJECT = re.compile(rb'"usage":\s*\{')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')

_NO_DEADLINE = contextlib.nullcontext()  # (a timeout scope costs as much as the rest of an exchange's set-up)
# An engine's answers that say it cannot take the request now (overloaded, going away): another replica may.
_RETRY_STATUSES = frozenset({502, 503})


def usage_of(data: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens of an answer or usage event, (0, 0) when it has none."""
    match = _USAGE_OBJECT.search(data)
    if match is None:
        return 0, 0
    prompt = _PROMPT_TOKENS.search(data, match.end())
    completion = _COMPLETION_TOKENS.search(data, match.end())
    return (int(prompt.group(1)) if prompt else 0), (int(completion.group(1)) if completion else 0)


class Attempt:
    """One request's trip through the gateway, for the metrics, the key's usage and its limits."""

    __slots__ = ("gw", "key", "model", "endpoint", "started", "ticket", "used")

    def __init__(self, gw: Gateway, key, model: str, endpoint: str, started: float, ticket=None) -> None:
        self.gw, self.key, self.model, self.endpoint, self.started = gw, key, model, endpoint, started
        # The limiter's reservation (gateway.limits.Ticket), settled here once; None: the key has no limits.
        self.ticket = ticket
        self.used = (0, 0)  # (prompt, completion) tokens as the engine reported them

    def done(self, route: Route | None, code: int, kind: str | None = None) -> None:
        ticket = self.ticket
        if ticket is not None and not ticket.settled:
            ticket.settled = True
            self.gw.limiter.settle(ticket, self.used[0] + self.used[1])
        if route is not None and self.key is not None:
            self.gw.count_hour(self.key, self.model, *self.used)
        queue = self.gw.queue
        if queue.models:
            queue.dispatch(self.gw, self.model)  # a slot came free: the next waiter (gateway/queue.py)
        metrics = self.gw.metrics
        replica = route.label if route is not None else ""
        metrics.request(self.model, replica, self.endpoint, code)
        if kind:
            metrics.error(self.model, kind)
        if route is not None:
            metrics.latency(self.model, replica, time.perf_counter() - self.started)


class _Failed(Exception):
    """An exchange that failed before any byte reached the client; ``retry``: another replica may take it."""

    def __init__(self, status: int, kind: str, message: str, *, retry: bool, down: bool = False,
                 same: bool = False) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.retry, self.down, self.same = retry, down, same


async def forward(attempt: Attempt, path: str, payload: bytes, *, stream: bool, strip_usage: bool,
                  hints: Hints = NO_HINTS) -> HttpResponse:
    """Send the request to a replica and answer with what it says. A failure before any byte reached the
    client (no connection, the engine's 502/503, no first token within the model's TTFT timeout) is tried
    once more on another replica; nothing is retried once the client has a byte."""
    gw, model = attempt.gw, attempt.model
    route = gw.table.pick(model, hints=hints)
    if route is None:  # the table changed since the caller looked
        return _no_replica(attempt)
    pending = gw.table.last_sent  # prompt tokens the decision counted as waiting for prefill on the route
    timeouts = gw.timeouts(model)
    loop = asyncio.get_running_loop()
    started = loop.time()
    total = started + timeouts.total if timeouts.total else None
    for tries in (1, 2):
        route.inflight += 1
        sent_to = route
        try:
            response, first = await _exchange(gw, route, path, payload, stream, timeouts, loop, total)
            break
        except _Failed as failed:
            route.inflight -= 1
            if failed.down:
                gw.table.mark_down(route)
            logger.warning("upstream failed before answering model=%s replica=%s url=%s error=%s",
                           model, route.replica_id, route.base_url, failed.message)
            other = gw.table.pick(model, exclude=route) if tries == 1 and failed.retry else None
            if other is None and tries == 1 and failed.same:
                other = route  # a stale pooled connection: the same replica again, on a new one
            if other is None:
                attempt.done(route, failed.status, failed.kind)
                return openai_error(failed.status, failed.message, failed.kind)
            gw.metrics.retry(model)
            route = other
        except asyncio.CancelledError:
            route.inflight -= 1
            attempt.done(route, 499, ErrorKind.CLIENT_DISCONNECTED)
            raise
        except BaseException:
            route.inflight -= 1
            raise
        finally:
            if pending:
                # Answered (a first chunk, a whole answer), failed or given up: its prompt no longer waits for
                # prefill there, whether or not the engine's next reading has come (gateway.routing's backlog).
                sent_to.prefilled_tokens += pending
                pending = 0
    if stream and response.status == 200:
        return _streaming(attempt, route, response, first, strip_usage, timeouts, total)
    route.inflight -= 1
    status = response.status
    if status == 200:
        attempt.used = usage_of(first)
        attempt.gw.count(attempt.key, *attempt.used, request=0)
    attempt.done(route, status, ErrorKind.UPSTREAM_ERROR if status >= 500 else None)
    return json_response(first, status=status, content_type=response.content_type or "application/json",
                         headers={"X-Llmgw-Replica": route.label})


async def _exchange(gw: Gateway, route: Route, path: str, payload: bytes, stream: bool, timeouts: Timeouts,
                    loop: asyncio.AbstractEventLoop, total: float | None) -> tuple[UpstreamResponse, bytes]:
    """The engine's response and its first bytes (a stream's first chunk, or a whole answer), or _Failed."""
    model = route.model
    ttft = loop.time() + timeouts.ttft if stream and timeouts.ttft else None
    deadline = min(ttft, total) if ttft is not None and total is not None else (ttft or total)
    response = None
    try:
        async with (asyncio.timeout_at(deadline) if deadline is not None else _NO_DEADLINE):
            response = await gw.upstream.post(route.host, route.port, path, payload,
                                              connect_timeout=timeouts.connect or None)
            status = response.status
            if status in _RETRY_STATUSES:
                body = await response.read()
                response.release()
                raise _Failed(502, ErrorKind.UPSTREAM_ERROR, f"replica {route.replica_id} of {model} answered "
                              f"{status}: {body[:200].decode(errors='replace')}", retry=True)
            if stream and status == 200:
                return response, await response.readany()
            body = await response.read()
            response.release()
            return response, body
    except _Failed:
        raise
    except ConnectTimeout as exc:
        raise _Failed(504, ErrorKind.UPSTREAM_TIMEOUT, f"could not connect to a replica of {model} within "
                      f"{timeouts.connect:g}s (replica {route.replica_id} at {route.base_url}: {exc})",
                      retry=True, down=True) from None
    except (NoConnection, Disconnected) as exc:
        no_connection = isinstance(exc, NoConnection)
        raise _Failed(502, ErrorKind.UPSTREAM_UNREACHABLE, f"could not reach a replica of {model} (replica "
                      f"{route.replica_id} at {route.base_url}: {exc})", retry=True, down=no_connection,
                      same=not no_connection) from None
    except TimeoutError:
        if response is not None:
            response.close()  # the engine sees the connection go and stops
        if ttft is not None and (total is None or ttft <= total):
            raise _Failed(504, ErrorKind.UPSTREAM_TIMEOUT, f"replica {route.replica_id} of {model} sent no first "
                          f"token within {timeouts.ttft:g}s (the model's TTFT timeout)", retry=True) from None
        raise _Failed(504, ErrorKind.UPSTREAM_TIMEOUT, f"replica {route.replica_id} of {model} did not finish "
                      f"within {timeouts.total:g}s (the model's total timeout)", retry=False) from None
    except Broken as exc:
        if response is not None:
            response.close()
        raise _Failed(502, ErrorKind.UPSTREAM_ERROR, f"replica {route.replica_id} of {model} broke off its "
                      f"answer: {exc}", retry=True) from None
    except BaseException:
        if response is not None:
            response.close()
        raise


def _streaming(attempt: Attempt, route: Route, response: UpstreamResponse, first: bytes, strip_usage: bool,
               timeouts: Timeouts, total: float | None) -> StreamingHttpResponse:
    relay = _Relay(attempt, route, response)
    result = StreamingHttpResponse(
        _relay(relay, first, strip_usage, timeouts, total),
        content_type=response.content_type or "text/event-stream",
    )
    # Django's way to free what a response holds: close() runs its closers (gateway.asgi runs them too).
    result._resource_closers.append(relay.close)
    result["Cache-Control"] = "no-cache"
    result["X-Accel-Buffering"] = "no"
    result["X-Llmgw-Replica"] = route.label
    return result


class _Relay:
    """What a streamed answer holds until it ends (the key's concurrency slot and token reservation, the
    replica's in-flight count, the upstream connection), given back once.

    The relay generator gives it back when it ends. A client that leaves
    between the response's head and its first chunk (the head's write waits
    for room in a slow reader's socket, and the disconnect cancels it there)
    means the generator never starts, and a generator that never started
    runs no ``finally``: the response's closer gives it back then."""

    __slots__ = ("attempt", "route", "response", "loop", "started", "ended")

    def __init__(self, attempt: Attempt, route: Route, response: UpstreamResponse) -> None:
        self.attempt, self.route, self.response = attempt, route, response
        self.loop = asyncio.get_running_loop()
        self.started = self.ended = False

    def end(self, code: int, kind: str | None, finished: bool, prompt: int = 0, completion: int = 0) -> None:
        if self.ended:
            return
        self.ended = True
        self.route.inflight -= 1
        if finished:
            self.response.release()
        else:
            self.response.close()  # the engine sees the connection go and stops generating
        attempt = self.attempt
        attempt.gw.count(attempt.key, prompt, completion, request=0)
        attempt.used = (prompt, completion)
        attempt.done(self.route, code, kind)

    def close(self) -> None:
        """The response's closer: after the last chunk, or instead of any. Runs on the event loop (Django's
        own handler calls closers from a thread)."""
        if self.ended:
            return
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self.end(499, ErrorKind.CLIENT_DISCONNECTED, False)
        else:
            self.loop.call_soon_threadsafe(self.end, 499, ErrorKind.CLIENT_DISCONNECTED, False)


async def _relay(relay: _Relay, first: bytes, strip_usage: bool, timeouts: Timeouts,
                 total: float | None) -> AsyncIterator[bytes]:
    relay.started = True
    if relay.ended:  # closed before its first chunk was asked for
        return
    attempt, route, response = relay.attempt, relay.route, relay.response
    gw, model = attempt.gw, attempt.model
    finished = False
    code, kind = 200, None
    prompt = completion = 0
    loop = asyncio.get_running_loop()
    idle = timeouts.idle
    gw.metrics.ttft(model, route.label, time.perf_counter() - attempt.started)
    chunk = first
    held = b""  # an event's beginning, until its end arrives: usage is found (and stripped) in whole events
    try:
        while chunk or held:
            if held:
                chunk, held = held + chunk, b""
            if chunk and not finished:
                end = _events_end(chunk)
                if len(chunk) - end <= _HELD_MAX:
                    chunk, held = chunk[:end], chunk[end:]
            if _USAGE_OBJECT.search(chunk):
                chunk, used = _take_usage(chunk, strip_usage)
                prompt, completion = used if used != (0, 0) else (prompt, completion)
            if chunk:
                yield chunk
            if finished:
                break
            # The wait for each next chunk is bounded by the idle timeout and what is left of the total
            # (a scope per read: a timeout must not span a yield, where the client's send runs).
            deadline = loop.time() + idle if idle else None
            if total is not None and (deadline is None or total < deadline):
                deadline = total
            if deadline is None:
                chunk = await response.readany()
            else:
                async with asyncio.timeout_at(deadline):
                    chunk = await response.readany()
            # The end of the stream: what was held goes out as it came (the loop's last turn).
            finished = not chunk
        finished = True
    except (asyncio.CancelledError, GeneratorExit):
        code, kind = 499, ErrorKind.CLIENT_DISCONNECTED
        raise
    except TimeoutError:
        code, kind = 504, ErrorKind.UPSTREAM_TIMEOUT
        which = (f"sent nothing for {idle:g}s (the model's idle timeout)" if total is None or loop.time() < total
                 else f"did not finish within {timeouts.total:g}s (the model's total timeout)")
        yield sse_error(f"replica {route.replica_id} of {model} {which}", kind, 504)
    except Broken as exc:
        code, kind = 502, ErrorKind.STREAM_BROKEN
        logger.warning("stream broken model=%s replica=%s error=%r", model, route.replica_id, exc)
        yield sse_error(f"replica {route.replica_id} of {model} broke off the stream: {exc}", kind, 502)
    finally:
        relay.end(code, kind, finished, prompt, completion)


# An event's beginning held back for its end at most this long (an engine's events are far shorter).
_HELD_MAX = 64 * 1024


def _events_end(chunk: bytes) -> int:
    """Where the chunk's last whole SSE event ends (0: none ends in it)."""
    lf, crlf = chunk.rfind(b"\n\n"), chunk.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _take_usage(chunk: bytes, strip: bool) -> tuple[bytes, tuple[int, int]]:
    """Find the final usage event (``"choices": []``) in a chunk; drop it when the client did not ask for it."""
    used = (0, 0)
    events = chunk.split(b"\n\n")
    kept = []
    for event in events:
        if _USAGE_OBJECT.search(event) and (b'"choices":[]' in event or b'"choices": []' in event):
            used = usage_of(event)
            if strip:
                continue
        kept.append(event)
    return b"\n\n".join(kept) if len(kept) != len(events) else chunk, used


def _no_replica(attempt: Attempt) -> HttpResponse:
    attempt.done(None, 503, ErrorKind.NO_READY_REPLICA)
    return openai_error(
        503, f"model {attempt.model} has no ready replica right now; try again shortly",
        ErrorKind.NO_READY_REPLICA, headers={"Retry-After": str(settings.LLMGW_GATEWAY_RETRY_AFTER)},
    )
