"""The OpenAI-compatible routes and /metrics: async views served by the lean
handler in ``gateway.asgi`` (no middleware, no thread per request)."""

from __future__ import annotations

import json
import logging
import time

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from . import metrics as metrics_module
from .choices import ErrorKind
from .errors import json_response, openai_error
from .proxy import Attempt, ask_for_usage, encode, forward
from .routing import Key
from .runtime import Gateway, gateway

logger = logging.getLogger(__name__)


def _refuse(gw: Gateway, endpoint: str, model: str, status: int, message: str, kind: str, **kwargs) -> HttpResponse:
    gw.metrics.request(model, "", endpoint, status)
    gw.metrics.error(model, kind)
    return openai_error(status, message, kind, **kwargs)


async def _authenticate(gw: Gateway, request: HttpRequest, endpoint: str) -> tuple[Key | None, HttpResponse | None]:
    key = await gw.authenticate_or_look_up(request.META.get("HTTP_AUTHORIZATION"))
    if key is None and not gw.open:
        given = "HTTP_AUTHORIZATION" in request.META
        message = ("Incorrect API key provided." if given else
                   "You didn't provide an API key: send it as 'Authorization: Bearer sk-llmgw-...'.")
        return None, _refuse(gw, endpoint, "", 401, message, ErrorKind.INVALID_API_KEY)
    gw.count(key)
    return key, None


def _method(gw: Gateway, request: HttpRequest, endpoint: str, allowed: str) -> HttpResponse | None:
    if request.method == allowed:
        return None
    return _refuse(gw, endpoint, "", 405, f"{request.path} accepts {allowed} only, not {request.method}.",
                   ErrorKind.METHOD_NOT_ALLOWED, headers={"Allow": allowed})


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
    refused = _method(gw, request, endpoint, "POST")
    if refused:
        return refused
    key, refused = await _authenticate(gw, request, endpoint)
    if refused:
        return refused
    raw = request.body
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return _refuse(gw, endpoint, "", 400, f"The body is not valid JSON: {exc}", ErrorKind.INVALID_REQUEST)
    problem = _problem(body, required)
    if problem:
        return _refuse(gw, endpoint, "", 400, problem[1], ErrorKind.INVALID_REQUEST, param=problem[0])
    model = body["model"]
    if key is not None and not key.allows(model):
        if model in gw.table.catalog:
            allowed = ", ".join(sorted(key.allowed_models or ()))
            return _refuse(gw, endpoint, model, 403, f"This API key may not use `{model}`; it may use: {allowed}.",
                           ErrorKind.MODEL_NOT_ALLOWED, param="model")
        return _refuse(gw, endpoint, "", 404, _unknown_model_message(gw, key, model), ErrorKind.MODEL_NOT_FOUND,
                       param="model")
    if model not in gw.table.by_model:
        if model in gw.table.catalog:
            return _refuse(gw, endpoint, model, 503, f"Model `{model}` has no ready replica right now; try again shortly.",
                           ErrorKind.NO_READY_REPLICA, headers={"Retry-After": str(settings.LLMGW_GATEWAY_RETRY_AFTER)})
        # An unknown name is not a metrics label: clients could make up any number of them.
        return _refuse(gw, endpoint, "", 404, _unknown_model_message(gw, key, model), ErrorKind.MODEL_NOT_FOUND,
                       param="model")
    stream = body.get("stream") is True and endpoint != "embeddings"
    strip_usage = False
    if stream:
        strip_usage = ask_for_usage(body)
        if strip_usage:
            raw = encode(body)
    attempt = Attempt(gw, key, model, endpoint, started)
    return await forward(attempt, path, raw, stream=stream, strip_usage=strip_usage)


def _problem(body, required: str) -> tuple[str | None, str] | None:
    """(param, message) for a body the engines would refuse, None when it may go on."""
    if not isinstance(body, dict):
        return None, "The body must be a JSON object."
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return "model", "You must provide a model parameter (a string)."
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        return "stream", "'stream' must be true or false."
    if required not in body:
        return required, f"Missing required parameter: '{required}'."
    if required == "messages" and (not isinstance(body["messages"], list) or not body["messages"]):
        return "messages", "'messages' must be a non-empty list of {role, content} objects."
    return None


async def metrics(request: HttpRequest) -> HttpResponse:
    gw = gateway()
    if request.method != "GET":
        return HttpResponse(status=405, headers={"Allow": "GET"})
    try:
        cluster = await gw.cluster_gauges()
    except Exception:
        logger.warning("metrics: could not read the cluster's figures", exc_info=True)
        cluster = None
    return json_response(metrics_module.render(cluster), content_type=metrics_module.CONTENT_TYPE)
