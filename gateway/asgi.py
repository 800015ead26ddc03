"""The lean ASGI path for /v1 and /metrics.

Django's own ASGI handler costs a gateway more than the proxying does: the
seven default middleware hop threads through ``sync_to_async`` on every
request (about 2.7 ms of CPU), and the handler runs each request in a
thread-sensitive context that starts a thread of its own. This handler keeps
what a proxy needs from Django (URL resolving, async views, the Host check,
StreamingHttpResponse, the client-disconnect watch) and drops the rest: no
middleware, no request signals, no threads. Its request is Django's
HttpRequest made from the scope with only what the views read (``META``,
``method``, ``path``, ``body``: no query dicts, cookies or content-type
parsing), and a Host header is checked against ``ALLOWED_HOSTS`` once per
distinct value; whole answers are ``gateway.errors.Answer``. Together with
the gateway's own client (``gateway.upstream``) these about halved a plain
request's CPU (docs/benchmarks.md, issue 20).
Nothing on this path touches the database (see ``gateway.runtime``).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.core.handlers import base
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpRequest
from django.urls import Resolver404, get_resolver

from . import views
from .choices import ErrorKind
from .errors import openai_error
from .runtime import gateway

logger = logging.getLogger(__name__)

GATEWAY_PREFIXES = ("/v1/",)
GATEWAY_PATHS = frozenset({"/metrics"})
# Header names to their META keys, as Django's ASGIRequest makes them (a name with "_" is dropped: it could
# pass for one with "-"); remembered for this many names.
_META_NAMES: dict[bytes, str | None] = {}
_META_NAMES_MAX = 512
# The scope extension by which the web process's protocol (web.protocol, which names it too) offers to call
# back when the client goes away: a callable taking the callback, or None to stop watching.
DISCONNECT_EXTENSION = "llmgw.on_disconnect"
_NONE: dict = {}
# Host header values that passed the ALLOWED_HOSTS check, remembered for this many.
_HOSTS_MAX = 256


def _meta_name(name: bytes) -> str | None:
    key = _META_NAMES.get(name, "")
    if key == "":
        text = name.decode("latin1")
        if "_" in text:
            key = None
        elif text == "content-length":
            key = "CONTENT_LENGTH"
        elif text == "content-type":
            key = "CONTENT_TYPE"
        else:
            key = "HTTP_" + text.upper().replace("-", "_")
        if len(_META_NAMES) < _META_NAMES_MAX:
            _META_NAMES[name] = key
    return key


class GatewayRequest(HttpRequest):
    """What the gateway's views read of a request (``META``, ``method``, ``path``, ``body``), made from the
    ASGI scope as Django's ASGIRequest makes them, without what /v1 never reads: no GET/POST query dicts,
    no cookies, no content-type parsing. ``get_host()`` is Django's own."""

    def __init__(self, scope) -> None:  # not HttpRequest.__init__: its dicts are what is left out
        self.scope = scope
        self.resolver_match = None
        self.path = path = scope["path"]
        root = scope.get("root_path") or ""
        self.path_info = path.removeprefix(root) if root else path
        self.method = method = scope["method"].upper()
        query = scope.get("query_string", b"")
        meta = {"REQUEST_METHOD": method, "QUERY_STRING": query.decode() if query else "", "SCRIPT_NAME": root,
                "PATH_INFO": self.path_info}
        client = scope.get("client")
        if client:
            meta["REMOTE_ADDR"] = meta["REMOTE_HOST"] = client[0]
            meta["REMOTE_PORT"] = client[1]
        server = scope.get("server")
        meta["SERVER_NAME"], meta["SERVER_PORT"] = (server[0], str(server[1])) if server else ("unknown", "0")
        for name, value in scope.get("headers", ()):
            key = _meta_name(name)
            if key is None:
                continue
            value = value.decode("latin1")
            meta[key] = f"{meta[key]},{value}" if key in meta else value
        self.META = meta


class GatewayHandler(ASGIHandler):
    request_class = GatewayRequest

    def __init__(self) -> None:
        base.BaseHandler.__init__(self)  # and not load_middleware()
        self.resolver = get_resolver("gateway.urls")
        self._routes: dict[str, tuple] = {}
        self._hosts: set[str] = set()
        # Fixed for the process's life: read once, not through Django's lazy settings on every request.
        self.body_limit = settings.LLMGW_GATEWAY_MAX_BODY_BYTES
        self.body_timeout = settings.LLMGW_GATEWAY_BODY_TIMEOUT

    async def __call__(self, scope, receive, send) -> None:
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send) -> None:
        try:
            request = self.request_class(scope)
        except UnicodeDecodeError:
            await self._send(_closing(
                openai_error(400, "The request line is not valid.", ErrorKind.INVALID_REQUEST)), send)
            return
        try:
            view, kwargs = self._resolve(request.path_info)
        except Resolver404:
            await self._send(_closing(
                openai_error(404, f"No route {request.method} {request.path_info}.", ErrorKind.NOT_FOUND)), send)
            return
        if not self._host_allowed(request):
            await self._send(_closing(openai_error(
                400, "The Host header names no address this server answers to (ALLOWED_HOSTS).",
                ErrorKind.INVALID_REQUEST)), send)
            return
        gw = gateway()
        if not gw.started:
            try:
                await gw.start()
            except Exception as exc:
                logger.exception("gateway could not load its routing table")
                await self._send(_closing(openai_error(
                    503, f"The gateway could not load its routing table: {exc}", ErrorKind.NO_READY_REPLICA,
                    headers={"Retry-After": str(settings.LLMGW_GATEWAY_RETRY_AFTER)})), send)
                return
        # Who is asking is in the headers: a caller without a valid key (or
        # a scraper without the metrics token) is answered before a byte of
        # its body is read, and the server reads no more of it than its own
        # small buffer (the connection closes).
        refused = await views.precheck(gw, request, view)
        if refused is not None:
            await self._send(_closing(refused), send)
            return
        body = await self._read_body(receive, send, self.body_limit, self.body_timeout)
        if body is None:
            return
        request._body = body  # read above; Django's own size limit is for forms, not prompts

        # As Django does, watch for the client going away while the view
        # works, and cancel it (and with it the upstream request) when it
        # does: by a callback the server calls (web.protocol), or where the
        # server offers none, by one watcher task waiting on receive().
        this = asyncio.current_task()
        state = {"finished": False, "aborted": False}

        def client_left() -> None:
            if not state["finished"]:
                state["aborted"] = True
                this.cancel()

        on_disconnect = (scope.get("extensions") or _NONE).get(DISCONNECT_EXTENSION)
        watcher = None
        if on_disconnect is not None:
            on_disconnect(client_left)
        else:
            async def watch() -> None:
                if (await receive())["type"] == "http.disconnect":
                    client_left()

            watcher = asyncio.get_running_loop().create_task(watch())
        response = None
        try:
            try:
                response = await view(request, **kwargs)
            except Exception:
                logger.exception("gateway error path=%s", request.path_info)
                response = openai_error(500, "The gateway failed on this request; its log says why.", ErrorKind.INTERNAL)
            await self._send(response, send)
        except asyncio.CancelledError:
            if not state["aborted"]:
                raise  # the server is stopping
            this.uncancel()
        finally:
            state["finished"] = True
            if watcher is None:
                on_disconnect(None)
            else:
                watcher.cancel()
            if response is not None and response.streaming:
                _run_closers(response)

    def _host_allowed(self, request: GatewayRequest) -> bool:
        """No middleware here: the Host check CommonMiddleware would make (DNS rebinding: a page elsewhere
        reaching /metrics or /v1 on loopback), by Django's get_host(), once per distinct Host header."""
        raw = request.META.get("HTTP_HOST")
        if raw is not None and raw in self._hosts:
            return True
        try:
            request.get_host()
        except DisallowedHost:
            return False
        if raw is not None and len(self._hosts) < _HOSTS_MAX and not settings.USE_X_FORWARDED_HOST:
            self._hosts.add(raw)
        return True

    @staticmethod
    async def _read_body(receive, send, limit: int, timeout: float) -> bytes | None:
        """The whole body, or None when the client went away or was answered
        (too large; not all there within LLMGW_GATEWAY_BODY_TIMEOUT)."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    if chunk:
                        size += len(chunk)
                        if size > limit:
                            await GatewayHandler._send(_closing(openai_error(
                                413, f"The body is larger than {limit} bytes.", ErrorKind.BODY_TOO_LARGE)), send)
                            return None
                        chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            await GatewayHandler._send(_closing(openai_error(
                408, f"The body did not arrive within {timeout:g} s ({size} bytes came).", ErrorKind.BODY_TIMEOUT)),
                send)
            return None

    def _resolve(self, path: str):
        """Django's URL resolving, remembered per path (resolving costs more than the rest of routing)."""
        hit = self._routes.get(path)
        if hit is None:
            match = self.resolver.resolve(path)
            hit = (match.func, match.kwargs)
            if len(self._routes) < 1024:
                self._routes[path] = hit
        return hit

    @staticmethod
    async def _send(response, send) -> None:
        """Django's send_response, less what /v1 never has (cookies, file
        responses): headers, then the body, or each streamed chunk as it comes."""
        headers = [(name.encode("latin1"), value.encode("latin1")) for name, value in response.items()]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        if not response.streaming:
            await send({"type": "http.response.body", "body": response.content})
            return
        async with aclosing(response.streaming_content) as chunks:
            async for chunk in chunks:
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def _run_closers(response) -> None:
    """What ``response.close()`` does for its resources (a stream's relay: gateway.proxy), without the
    request_finished signal this path never sends. Whatever happened to the send: a stream whose client left
    before its first chunk never started its relay, and only the closer gives back what it holds."""
    for closer in response._resource_closers:
        try:
            closer()
        except Exception:
            logger.exception("gateway: a response's closer failed")
    response._resource_closers.clear()


def _closing(response):
    """A response after which the connection closes: its request's body may
    be unread, and what follows on the connection is not a request."""
    response["Connection"] = "close"
    return response


def with_gateway(django_application):
    """The web process's ASGI application: /v1 and /metrics to the gateway,
    everything else to Django as usual. Lifespan events start and stop the
    gateway when the server sends them (it also starts on first use)."""
    handler = GatewayHandler()
    if settings.LLMGW_GATEWAY_OPEN:
        logger.warning(
            "LLMGW_GATEWAY_OPEN is set: /v1 serves ANYONE WITHOUT AN API KEY. This is for a demo on a laptop; "
            "unset it and create keys with 'llmgw ctl keys create NAME' before anyone else can reach this port."
        )

    async def application(scope, receive, send):
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if path.startswith(GATEWAY_PREFIXES) or path in GATEWAY_PATHS:
                return await handler(scope, receive, send)
        elif kind == "lifespan":
            return await _lifespan(receive, send)
        return await django_application(scope, receive, send)

    return application


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await gateway().start()
            except Exception:
                # Not fatal: the dashboard still works, and /v1 tries again on first use.
                logger.exception("gateway could not start; /v1 will try again on its first request")
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            try:
                await gateway().stop()
            except Exception:
                logger.exception("gateway did not stop cleanly")
            await send({"type": "lifespan.shutdown.complete"})
            return
