"""Errors in the shape OpenAI's API and its clients use:
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from .choices import ERROR_TYPES


class Answer:
    """A whole answer of the lean path (``gateway.asgi``): a status, headers and a body. Django's
    HttpResponse did the same at several times the cost on every request (its header map checks and
    re-encodes each name and value; its content setter copies the body). Names are as written here and
    compared without case; values are ours or an engine's content type (one line: llhttp parsed it)."""

    streaming = False
    __slots__ = ("status_code", "content", "_headers")

    def __init__(self, content: bytes, status: int = 200, content_type: str = "application/json") -> None:
        self.status_code = status
        self.content = content
        # No middleware runs on /v1: say the length, or the server falls back to chunked encoding.
        self._headers = {"content-type": ("Content-Type", content_type),
                         "content-length": ("Content-Length", str(len(content)))}

    def __setitem__(self, name: str, value: str) -> None:
        if "\n" in value or "\r" in value:
            raise ValueError(f"header {name!r} has a line break in its value")
        self._headers[name.lower()] = (name, value)

    def __getitem__(self, name: str) -> str:
        return self._headers[name.lower()][1]

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._headers

    def get(self, name: str, default: str | None = None) -> str | None:
        found = self._headers.get(name.lower())
        return default if found is None else found[1]

    def items(self):
        return self._headers.values()


def error_body(status: int, message: str, code: str, param: str | None = None, type_: str | None = None) -> bytes:
    kind = type_ or ERROR_TYPES.get(status, "server_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def openai_error(status: int, message: str, code: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None) -> Answer:
    return json_response(error_body(status, message, code, param, type_), status=status, headers=headers)


def json_response(body: bytes, *, status: int = 200, content_type: str = "application/json",
                  headers: dict[str, str] | None = None) -> Answer:
    response = Answer(body, status, content_type)
    if headers:
        for name, value in headers.items():
            response[name] = value
    return response


def sse_error(message: str, code: str, status: int = 502) -> bytes:
    """An error event that ends a stream cleanly (the openai SDK raises it as an APIError)."""
    return b"data: " + error_body(status, message, code) + b"\n\n"
