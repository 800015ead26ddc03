"""The simulated engine's OpenAI-compatible HTTP API (served by the leader only).

``/health``, ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``,
streaming (server-sent events, one token per event, ``token_delay`` apart)
and not, with usage counts, in the shapes the OpenAI API and vLLM use. The
"model" says the same sentence every time; what it exercises is the path a
request takes, not what a model would answer.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

_WORD = re.compile(r"\S+")


# The leader's load, written where the simulated node's fake NVML reads it
# (agent.nvml_fake): its GPUs' utilisation follows the requests in flight.
LOAD_FILE = "sim-load.json"


class _Load:
    def __init__(self) -> None:
        self.in_flight = 0
        self.served = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1
            self.served += 1

    def keep_writing(self, path: str = LOAD_FILE, every: float = 0.5) -> None:
        # Only in a member's directory (the agent's record beside it, or one
        # level up for an engine run as another user): a sim engine started
        # by hand writes nothing where it happens to run.
        if not (os.path.exists("engine.json") or os.path.exists(os.path.join("..", "engine.json"))):
            return

        def loop() -> None:
            last = None
            while True:
                now = (self.in_flight, self.served)
                if now != last:
                    try:
                        with open(path + ".tmp", "w") as f:
                            json.dump({"in_flight": now[0], "served": now[1], "at": time.time()}, f)
                        os.replace(path + ".tmp", path)
                        last = now
                    except OSError:
                        pass  # a read-only working directory: no load to show, nothing else changes
                time.sleep(every)

        threading.Thread(target=loop, name="sim-load", daemon=True).start()


LOAD = _Load()


def count_tokens(text: str) -> int:
    return len(_WORD.findall(text))


class SimModel:
    def __init__(self, name: str, token_delay: float) -> None:
        self.name = name
        self.token_delay = token_delay
        self.created = int(time.time())
        self.sentence = f"This is {name} answering from the llmgw simulated engine; no GPU was harmed."

    def tokens(self, max_tokens: int | None) -> tuple[list[str], str]:
        """The reply as tokens (each but the first carries its leading space), and the finish reason."""
        words = self.sentence.split(" ")
        tokens = [w if i == 0 else " " + w for i, w in enumerate(words)]
        if max_tokens is not None and max_tokens < len(tokens):
            return tokens[:max_tokens], "length"
        return tokens, "stop"


def _prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    if chat:
        total = 0
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += count_tokens(content)
            elif isinstance(content, list):
                total += sum(count_tokens(p.get("text", "")) for p in content if isinstance(p, dict))
            total += 1  # the role marker
        return total
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return sum(count_tokens(p) if isinstance(p, str) else 1 for p in prompt)
    return count_tokens(str(prompt))


class BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class SimHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "llmgw-sim"
    # A response written in two pieces (headers, then body) must not wait on
    # the client's delayed ACK: about 40 ms per answer with Nagle on.
    disable_nagle_algorithm = True
    model: SimModel  # set on the subclass made by make_server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # one line per request would drown the engine's log under load

    # --- routing -------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send(200, b"", "text/plain")
        elif path == "/v1/models":
            self._json(200, {
                "object": "list",
                "data": [{"id": self.model.name, "object": "model", "created": self.model.created,
                          "owned_by": "llmgw-sim", "root": self.model.name, "parent": None}],
            })
        else:
            self._error(404, f"no route for GET {path}", "not_found_error")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        LOAD.enter()
        try:
            body = self._body()
            if path == "/v1/chat/completions":
                self._complete(body, chat=True)
            elif path == "/v1/completions":
                self._complete(body, chat=False)
            else:
                raise BadRequest(404, f"no route for POST {path}", "not_found_error")
        except BadRequest as exc:
            self._error(exc.status, str(exc), exc.kind)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            LOAD.leave()

    # --- completions -----------------------------------------------------------------------

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError as exc:
            raise BadRequest(400, f"the body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest(400, "the body must be a JSON object")
        return body

    def _complete(self, body: dict[str, Any], *, chat: bool) -> None:
        model = body.get("model")
        if model != self.model.name:
            raise BadRequest(404, f"The model `{model}` does not exist.", "NotFoundError")
        if chat and not isinstance(body.get("messages"), list):
            raise BadRequest(400, "'messages' must be a list of {role, content}")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise BadRequest(400, "'max_tokens' must be a positive integer")
        tokens, finish = self.model.tokens(max_tokens)
        usage = {
            "prompt_tokens": _prompt_tokens(body, chat),
            "completion_tokens": len(tokens),
            "total_tokens": 0,
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._stream(_events(self.model, ident, tokens, finish, usage if include_usage else None, chat))
            return
        time.sleep(self.model.token_delay * len(tokens))
        text = "".join(tokens)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        self._json(200, {
            "id": ident, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model.name, "choices": [choice], "usage": usage,
        })

    def _stream(self, events: Iterator[dict[str, Any] | None]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in events:
            data = b"data: [DONE]\n\n" if event is None else b"data: " + json.dumps(event).encode() + b"\n\n"
            self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # --- responses ---------------------------------------------------------------------------

    def _json(self, status: int, value: Any) -> None:
        self._send(status, json.dumps(value).encode(), "application/json")

    def _error(self, status: int, message: str, kind: str) -> None:
        self._json(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})

    def _send(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def _events(model: SimModel, ident: str, tokens: list[str], finish: str, usage: dict | None, chat: bool):
    """The SSE events of one streamed completion; None stands for ``[DONE]``."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        event = {"id": ident, "object": kind, "created": created, "model": model.name,
                 "choices": [choice] if choice else []}
        if usage is not None:
            event["usage"] = None
        event.update(extra)
        return event

    if chat:
        yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None})
    for token in tokens:
        time.sleep(model.token_delay)
        if chat:
            yield chunk({"index": 0, "delta": {"content": token}, "logprobs": None, "finish_reason": None})
        else:
            yield chunk({"index": 0, "text": token, "logprobs": None, "finish_reason": None})
    if chat:
        yield chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish})
    else:
        yield chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": finish})
    if usage is not None:
        yield chunk(None, usage=usage)
    yield None


class _SimServer(ThreadingHTTPServer):
    # The default backlog of 5 resets clients when dozens connect at once.
    request_queue_size = 1024


def make_server(host: str, port: int, model: SimModel) -> ThreadingHTTPServer:
    handler = type("BoundSimHandler", (SimHandler,), {"model": model})
    server = _SimServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="sim-http", daemon=True)
    thread.start()
    return thread
