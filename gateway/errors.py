"""Errors in the shape OpenAI's API and its clients use:
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from django.http import HttpResponse

from .choices import ERROR_TYPES


def error_body(status: int, message: str, code: str, param: str | None = None, type_: str | None = None) -> bytes:
    kind = type_ or ERROR_TYPES.get(status, "server_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def openai_error(status: int, message: str, code: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None) -> HttpResponse:
    return json_response(error_body(status, message, code, param, type_), status=status, headers=headers)


def json_response(body: bytes, *, status: int = 200, content_type: str = "application/json",
                  headers: dict[str, str] | None = None) -> HttpResponse:
    response = HttpResponse(body, status=status, content_type=content_type)
    # No middleware runs on /v1: say the length, or the server falls back to chunked encoding.
    response["Content-Length"] = str(len(body))
    if headers:
        for name, value in headers.items():
            response[name] = value
    return response


def sse_error(message: str, code: str, status: int = 502) -> bytes:
    """An error event that ends a stream cleanly (the openai SDK raises it as an APIError)."""
    return b"data: " + error_body(status, message, code) + b"\n\n"
