"""The OpenAI-compatible routes and /metrics: async views served by the lean
handler in ``gateway.asgi`` (no middleware, no thread per request)."""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import logging
import time
from concurrent.futures.process import BrokenProcessPool

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from . import limits as limits_module
from . import metrics as metrics_module
from .choices import ErrorKind, Priority
from .errors import json_response, openai_error
from .limits import Ticket, estimate_tokens
from .queue import Refusal as QueueRefusal
from .proxy import Attempt, encode, forward
from .prefix import session_hash
from .routing import NO_HINTS, SESSION, Hints, Key
from .runtime import Gateway, gateway

logger = logging.getLogger(__name__)


def _refuse(gw: Gateway, endpoint: str, model: str, status: int, message: str, kind: str, **kwargs) -> HttpResponse:
    gw.metrics.request(model, "", endpoint, status)
    gw.metrics.error(model, kind)
    return openai_error(status, message, kind, **kwargs)


async def _key(gw: Gateway, request: HttpRequest, endpoint: str) -> tuple[Key | None, HttpResponse | None]:
    key = await gw.authenticate_or_look_up(request.META.get("HTTP_AUTHORIZATION"))
    if key is None and not gw.open:
        given = "HTTP_AUTHORIZATION" in request.META
        message = ("Incorrect API key provided." if given else
                   "You didn't provide an API key: send it as 'Authorization: Bearer sk-llmgw-...'.")
        return None, _refuse(gw, endpoint, "", 401, message, ErrorKind.INVALID_API_KEY)
    if key is not None and key.expires_at is not None and key.expires_at <= time.time():
        expired = datetime.datetime.fromtimestamp(key.expires_at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        return None, _refuse(gw, endpoint, "", 401, f"The API key {key.name} expired at {expired}; ask an operator "
                             "to extend it ('llmgw ctl keys update NAME --expires ...') or for a new one.",
                             ErrorKind.KEY_EXPIRED)
    return key, None


async def _authenticate(gw: Gateway, request: HttpRequest, endpoint: str) -> tuple[Key | None, HttpResponse | None]:
    checked = getattr(request, "gateway_key", None)  # found by precheck, for the same request
    key, refused = checked if checked is not None else await _key(gw, request, endpoint)
    if refused is None:
        gw.count(key)
    return key, refused


async def precheck(gw: Gateway, request: HttpRequest, view) -> HttpResponse | None:
    """The refusal of a request from its headers alone (wrong method, no
    valid key, no metrics token), before its body is read; None to go on."""
    if view is metrics:
        return _metrics_refusal(request)
    endpoint, allowed = ENDPOINTS[view]
    refused = _method(gw, request, endpoint, allowed) or _media_type(gw, request, endpoint)
    if refused is not None:
        return refused
    request.gateway_key = found = await _key(gw, request, endpoint)
    return found[1]


def _method(gw: Gateway, request: HttpRequest, endpoint: str, allowed: str) -> HttpResponse | None:
    if request.method == allowed:
        return None
    return _refuse(gw, endpoint, "", 405, f"{request.path} accepts {allowed} only, not {request.method}.",
                   ErrorKind.METHOD_NOT_ALLOWED, headers={"Allow": allowed})


def _media_type(gw: Gateway, request: HttpRequest, endpoint: str) -> HttpResponse | None:
    """A POST body must say it is JSON. text/plain, forms and multipart are
    what a web page may send cross-site without asking (a CORS "simple"
    request): refusing them keeps a browser from being used as a client."""
    if request.method != "POST":
        return None
    given = request.META.get("CONTENT_TYPE", "")
    if given.split(";", 1)[0].strip().lower() == "application/json":
        return None
    return _refuse(gw, endpoint, "", 415, f"Send the body as JSON with 'Content-Type: application/json' "
                   f"(this request said {given or 'nothing'!r}).", ErrorKind.UNSUPPORTED_MEDIA_TYPE)


def _model_object(gw: Gateway, name: str) -> dict:
    """A model as OpenAI's /v1/models lists it."""
    return {"id": name, "object": "model", "created": gw.table.catalog.get(name, 0), "owned_by": "llmgw"}


def _visible(gw: Gateway, key: Key | None) -> list[str]:
    return sorted(m for m in gw.table.catalog if key is None or key.allows(m))


async def models(request: HttpRequest) -> HttpResponse:
    gw = gateway()
    refused = _method(gw, request, "models", "GET")
    if refused:
        return refused
    key, refused = await _authenticate(gw, request, "models")
    if refused:
        return refused
    data = [_model_object(gw, name) for name in gw.table.ready_models() if key is None or key.allows(name)]
    gw.metrics.request("", "", "models", 200)
    return json_response(encode({"object": "list", "data": data}))


async def model_detail(request: HttpRequest, model: str) -> HttpResponse:
    gw = gateway()
    refused = _method(gw, request, "models", "GET")
    if refused:
        return refused
    key, refused = await _authenticate(gw, request, "models")
    if refused:
        return refused
    if model not in gw.table.by_model or (key is not None and not key.allows(model)):
        return _refuse(gw, "models", "", 404, _unknown_model_message(gw, key, model), ErrorKind.MODEL_NOT_FOUND,
                       param="model")
    gw.metrics.request(model, "", "models", 200)
    return json_response(encode(_model_object(gw, model)))


def _unknown_model_message(gw: Gateway, key: Key | None, model: str) -> str:
    names = _visible(gw, key)
    return (f"The model `{model}` does not exist. Models: {', '.join(names)}." if names else
            f"The model `{model}` does not exist: the catalog is empty.")


async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _proxy(request, "/v1/chat/completions", "chat", "messages")


async def completions(request: HttpRequest) -> HttpResponse:
    return await _proxy(request, "/v1/completions", "completions", "prompt")


async def embeddings(request: HttpRequest) -> HttpResponse:
    return await _proxy(request, "/v1/embeddings", "embeddings", "input")


async def _proxy(request: HttpRequest, path: str, endpoint: str, required: str) -> HttpResponse:
    started = time.perf_counter()
    gw = gateway()
    refused = _method(gw, request, endpoint, "POST") or _media_type(gw, request, endpoint)
    if refused:
        return refused
    key, refused = await _authenticate(gw, request, endpoint)
    if refused:
        return refused
    try:
        checked = await gw.bodies.check(request.body, required, endpoint != "embeddings", gw.hashing)
    except BrokenProcessPool:
        logger.exception("gateway: a body-parsing process died")
        return _refuse(gw, endpoint, "", 503, "The gateway could not parse this body now; try again shortly.",
                       ErrorKind.INTERNAL, headers={"Retry-After": str(settings.LLMGW_GATEWAY_RETRY_AFTER)})
    if checked.problem:
        return _refuse(gw, endpoint, "", 400, checked.problem[1], ErrorKind.INVALID_REQUEST, param=checked.problem[0])
    model = checked.model
    if key is not None and not key.allows(model):
        # The same answer as for a name that exists nowhere: a key restricted
        # to some models learns nothing of the others, not even their names.
        return _refuse(gw, endpoint, "", 404, _unknown_model_message(gw, key, model), ErrorKind.MODEL_NOT_FOUND,
                       param="model")
    if model in gw.table.catalog:
        gw.load.seen(model)
    if model not in gw.table.by_model and gw.holds.holds(model):
        # Autoscaled and starting (at zero, say): held until a replica is ready (gateway/hold.py).
        refused = await gw.holds.hold(gw, model)
        if refused is not None:
            gw.metrics.request(model, "", endpoint, refused.status_code)
            gw.metrics.error(model, ErrorKind.MODEL_STARTING)
            return refused
    if model not in gw.table.by_model:
        if model in gw.table.catalog:
            return _refuse(gw, endpoint, model, 503, f"Model `{model}` has no ready replica right now; try again shortly.",
                           ErrorKind.NO_READY_REPLICA, headers={"Retry-After": str(settings.LLMGW_GATEWAY_RETRY_AFTER)})
        # An unknown name is not a metrics label: clients could make up any number of them.
        return _refuse(gw, endpoint, "", 404, _unknown_model_message(gw, key, model), ErrorKind.MODEL_NOT_FOUND,
                       param="model")
    raw = checked.body if checked.body is not None else request.body
    verdict = ticket = None
    if key is not None and key.limits is not None:
        limits = key.limits
        estimate = (estimate_tokens(len(raw), checked.max_tokens, settings.LLMGW_LIMITS_COMPLETION_ESTIMATE)
                    if limits.tokens else 0)
        verdict = await gw.limiter.admit(key.id, limits, estimate)
        if not verdict.admitted:
            return _limited(gw, endpoint, model, key, verdict)
        ticket = Ticket(verdict)
    try:
        # Every ready replica at capacity: wait here, in priority order (gateway/queue.py).
        await gw.queue.enter(gw, model, key.id if key is not None else 0,
                             key.priority if key is not None else Priority.STANDARD)
    except QueueRefusal as refusal:
        _give_back(gw, ticket)
        return _refuse(gw, endpoint, model, refusal.status, refusal.message, refusal.kind,
                       headers={"Retry-After": str(refusal.retry_after), **(verdict.headers() if verdict else {})})
    except BaseException:
        _give_back(gw, ticket)
        raise
    attempt = Attempt(gw, key, model, endpoint, started, ticket)
    hints = NO_HINTS
    if checked.blocks:
        hints = Hints(blocks=checked.blocks, chars=checked.prompt_chars)
    elif gw.table.policies.get(model) == SESSION:
        session = request.META.get("HTTP_X_SESSION_ID") or checked.user
        if session:
            hints = Hints(session=session_hash(session))
    try:
        response = await forward(attempt, path, raw, stream=checked.stream, strip_usage=checked.strip_usage,
                                 hints=hints)
    except BaseException:
        if ticket is not None and not ticket.settled:
            attempt.done(None, 499, ErrorKind.CLIENT_DISCONNECTED)
        raise
    if verdict is not None:
        for name, value in verdict.headers().items():
            response[name] = value
    return response


def _give_back(gw: Gateway, ticket: Ticket | None) -> None:
    """A reservation whose request never reached an engine: nothing used."""
    if ticket is not None and not ticket.settled:
        ticket.settled = True
        gw.limiter.settle(ticket, 0)


def _limited(gw: Gateway, endpoint: str, model: str, key: Key, verdict) -> HttpResponse:
    """429 for a key past one of its limits, as OpenAI answers it."""
    quota = verdict.reason in (limits_module.DAILY, limits_module.MONTHLY)
    code = ErrorKind.QUOTA_EXCEEDED if quota else ErrorKind.RATE_LIMITED
    kind = "insufficient_quota" if quota else ("tokens" if verdict.reason == limits_module.TPM else "requests")
    headers = {"Retry-After": str(verdict.retry_after()), **verdict.headers()}
    return _refuse(gw, endpoint, model, 429, verdict.message(key.name), code, headers=headers, type_=kind)


async def metrics(request: HttpRequest) -> HttpResponse:
    gw = gateway()
    refused = _metrics_refusal(request)
    if refused is not None:
        return refused
    try:
        cluster = await gw.cluster_gauges()
    except Exception:
        logger.warning("metrics: could not read the cluster's figures", exc_info=True)
        cluster = None
    return json_response(metrics_module.render(cluster), content_type=metrics_module.CONTENT_TYPE)


def _metrics_refusal(request: HttpRequest) -> HttpResponse | None:
    """/metrics names every model and node: with LLMGW_METRICS_TOKEN set, a
    scraper sends it as a bearer token; unset, only loopback callers get an answer."""
    if request.method != "GET":
        return json_response(b"/metrics answers GET only.\n", status=405, content_type="text/plain",
                             headers={"Allow": "GET"})
    token = settings.LLMGW_METRICS_TOKEN
    if token:
        given = request.META.get("HTTP_AUTHORIZATION", "")
        if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return None
        return json_response(b"/metrics needs 'Authorization: Bearer <LLMGW_METRICS_TOKEN>'.\n", status=401,
                             content_type="text/plain", headers={"WWW-Authenticate": 'Bearer realm="metrics"'})
    try:
        loopback = ipaddress.ip_address(request.META.get("REMOTE_ADDR") or "").is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return json_response(b"/metrics answers loopback callers only; set LLMGW_METRICS_TOKEN to let a scraper "
                         b"elsewhere in with 'Authorization: Bearer <token>'.\n", status=403, content_type="text/plain")


# The endpoint label and the one method of each view (for answers made before the body is read).
ENDPOINTS = {
    models: ("models", "GET"),
    model_detail: ("models", "GET"),
    chat_completions: ("chat", "POST"),
    completions: ("completions", "POST"),
    embeddings: ("embeddings", "POST"),
}
