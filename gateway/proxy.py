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
import logging
import re
import time
from typing import AsyncIterator

import aiohttp
from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse

from .bodycheck import ask_for_usage, encode  # noqa: F401 - callers import them from here
from .choices import ErrorKind
from .errors import json_response, openai_error, sse_error
from .routing import NO_HINTS, Hints, Route
from .runtime import Gateway

logger = logging.getLogger(__name__)

_UPSTREAM_HEADERS = {"Content-Type": "application/json"}
_USAGE_OBJECT = re.compile(rb'"usage":\s*\{')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')

# Failures before the engine answered: the request can go to another replica.
# (ClientConnectorError and ConnectionTimeoutError: no connection at all.
# ServerDisconnectedError and ClientOSError: a pooled connection the engine had closed.)
_NO_CONNECTION = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, aiohttp.ServerDisconnectedError,
              aiohttp.ClientOSError)
_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


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
        metrics = self.gw.metrics
        replica = route.label if route is not None else ""
        metrics.request(self.model, replica, self.endpoint, code)
        if kind:
            metrics.error(self.model, kind)
        if route is not None:
            metrics.latency(self.model, replica, time.perf_counter() - self.started)


async def forward(attempt: Attempt, path: str, payload: bytes, *, stream: bool, strip_usage: bool,
                  hints: Hints = NO_HINTS) -> HttpResponse:
    gw, model = attempt.gw, attempt.model
    route = gw.table.pick(model, hints=hints)
    if route is None:  # the table changed since the caller looked
        return _no_replica(attempt)
    response = None
    for tries in (1, 2):
        route.inflight += 1
        try:
            response = await gw.session.post(route.url(path), data=payload, headers=_UPSTREAM_HEADERS)
            break
        except _RETRYABLE as exc:
            route.inflight -= 1
            no_connection = isinstance(exc, _NO_CONNECTION)
            if no_connection:
                gw.table.mark_down(route)
            logger.warning("upstream failed before answering model=%s replica=%s url=%s error=%r",
                           model, route.replica_id, route.base_url, exc)
            other = gw.table.pick(model, exclude=route) if tries == 1 else None
            if other is None and tries == 1 and not no_connection:
                other = route  # a stale pooled connection: the same replica again, on a new one
            if other is None:
                timeout = isinstance(exc, aiohttp.ConnectionTimeoutError)
                kind = ErrorKind.UPSTREAM_TIMEOUT if timeout else ErrorKind.UPSTREAM_UNREACHABLE
                attempt.done(route, 504 if timeout else 502, kind)
                return openai_error(
                    504 if timeout else 502,
                    f"could not reach a replica of {model} (replica {route.replica_id} at {route.base_url}: {exc})",
                    kind,
                )
            gw.metrics.retry(model)
            route = other
        except TimeoutError:
            route.inflight -= 1
            attempt.done(route, 504, ErrorKind.UPSTREAM_TIMEOUT)
            return _timeout(model, route)
        except asyncio.CancelledError:
            route.inflight -= 1
            attempt.done(route, 499, ErrorKind.CLIENT_DISCONNECTED)
            raise
        except BaseException:
            route.inflight -= 1
            raise
    if stream and response.status == 200:
        return _streaming(attempt, route, response, strip_usage)
    return await _whole(attempt, route, response)


async def _whole(attempt: Attempt, route: Route, response: aiohttp.ClientResponse) -> HttpResponse:
    """Read the engine's whole answer, then send it with its length."""
    model = attempt.model
    read = False
    try:
        body = await response.read()
        read = True
    except asyncio.CancelledError:
        attempt.done(route, 499, ErrorKind.CLIENT_DISCONNECTED)
        raise
    except TimeoutError:
        attempt.done(route, 504, ErrorKind.UPSTREAM_TIMEOUT)
        return _timeout(model, route)
    except _BROKEN as exc:
        attempt.done(route, 502, ErrorKind.UPSTREAM_ERROR)
        return openai_error(502, f"replica {route.replica_id} of {model} broke off its answer: {exc}",
                            ErrorKind.UPSTREAM_ERROR)
    finally:
        route.inflight -= 1
        if read:
            response.release()
        else:
            response.close()
    status = response.status
    if status == 200:
        attempt.used = usage_of(body)
        attempt.gw.count(attempt.key, *attempt.used, request=0)
    attempt.done(route, status, ErrorKind.UPSTREAM_ERROR if status >= 500 else None)
    return json_response(body, status=status, content_type=response.headers.get("Content-Type", "application/json"),
                         headers={"X-Llmgw-Replica": route.label})


def _streaming(attempt: Attempt, route: Route, response: aiohttp.ClientResponse, strip_usage: bool) -> StreamingHttpResponse:
    result = StreamingHttpResponse(
        _relay(attempt, route, response, strip_usage),
        content_type=response.headers.get("Content-Type", "text/event-stream"),
    )
    result["Cache-Control"] = "no-cache"
    result["X-Accel-Buffering"] = "no"
    result["X-Llmgw-Replica"] = route.label
    return result


async def _relay(attempt: Attempt, route: Route, response: aiohttp.ClientResponse, strip_usage: bool) -> AsyncIterator[bytes]:
    gw, model = attempt.gw, attempt.model
    first = True
    finished = False
    code, kind = 200, None
    prompt = completion = 0
    try:
        async for chunk in response.content.iter_any():
            if first:
                first = False
                gw.metrics.ttft(model, route.label, time.perf_counter() - attempt.started)
            if _USAGE_OBJECT.search(chunk):
                chunk, used = _take_usage(chunk, strip_usage)
                prompt, completion = used if used != (0, 0) else (prompt, completion)
                if not chunk:
                    continue
            yield chunk
        finished = True
    except (asyncio.CancelledError, GeneratorExit):
        code, kind = 499, ErrorKind.CLIENT_DISCONNECTED
        raise
    except TimeoutError:
        code, kind = 504, ErrorKind.UPSTREAM_TIMEOUT
        yield sse_error(f"replica {route.replica_id} of {model} went silent mid-stream", kind, 504)
    except _BROKEN as exc:
        code, kind = 502, ErrorKind.STREAM_BROKEN
        logger.warning("stream broken model=%s replica=%s error=%r", model, route.replica_id, exc)
        yield sse_error(f"replica {route.replica_id} of {model} broke off the stream: {exc}", kind, 502)
    finally:
        route.inflight -= 1
        if finished:
            response.release()
        else:
            response.close()  # the engine sees the connection go and stops generating
        gw.count(attempt.key, prompt, completion, request=0)
        attempt.used = (prompt, completion)
        attempt.done(route, code, kind)


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


def _timeout(model: str, route: Route) -> HttpResponse:
    return openai_error(504, f"replica {route.replica_id} of {model} did not answer in time", ErrorKind.UPSTREAM_TIMEOUT)


def _no_replica(attempt: Attempt) -> HttpResponse:
    attempt.done(None, 503, ErrorKind.NO_READY_REPLICA)
    return openai_error(
        503, f"model {attempt.model} has no ready replica right now; try again shortly",
        ErrorKind.NO_READY_REPLICA, headers={"Retry-After": str(settings.LLMGW_GATEWAY_RETRY_AFTER)},
    )
