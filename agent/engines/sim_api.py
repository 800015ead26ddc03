"""The simulated engine's OpenAI-compatible HTTP API (served by the leader only).

``/health``, ``/metrics`` (Prometheus, vLLM's names: ``sim_metrics``),
``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``, streaming
(server-sent events, one token per event) and not, with usage counts (and
``prompt_tokens_details.cached_tokens``) in the shapes the OpenAI API and
vLLM use. The "model" says the same sentence every time; what it exercises
is the path a request takes and the time an engine would take
(``sim_model``: queueing, prefix caching, prefill and decode), not what a
model would answer.

Each request is a thread of the HTTP server that waits for its turn and
sleeps through its prefill and decode steps; the engine model only does
arithmetic under a lock, so a request costs little more than its sleep.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from .sim_metrics import CONTENT_TYPE_LATEST, SimMetrics
from .sim_model import RequestTooLarge, SimEngine, SimParams

_WORD = re.compile(r"\S+")


def words(text: str) -> list[str]:
    return _WORD.findall(text)


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


class SimModel:
    """The served model: its name, its reply, its performance model and metrics."""

    def __init__(self, name: str, params: SimParams | None = None) -> None:
        self.name = name
        self.params = params or SimParams()
        self.engine = SimEngine(self.params)
        self.metrics = SimMetrics(name, self.engine)
        self.created = int(time.time())
        self.sentence = f"This is {name} answering from the llmgw simulated engine; no GPU was harmed."

    def tokens(self, max_tokens: int | None) -> tuple[list[str], str]:
        """The reply as tokens (each but the first carries its leading space), and the finish reason.

        Without ``max_tokens`` the model says its sentence and stops; with it,
        it says exactly that many tokens (the sentence over again), as a
        benchmark asking for a length wants.
        """
        words = self.sentence.split(" ")
        if max_tokens is None:
            return [w if i == 0 else " " + w for i, w in enumerate(words)], "stop"
        return [words[i % len(words)] if i == 0 else " " + words[i % len(words)] for i in range(max_tokens)], "length"


def _prompt_tokens(body: dict[str, Any], chat: bool) -> list[str]:
    """The prompt as the engine's tokens: whitespace-separated words, and a
    marker per chat message (so the same text always gives the same blocks)."""
    if chat:
        tokens: list[str] = []
        for message in body.get("messages") or []:
            role = message.get("role") if isinstance(message, dict) else None
            tokens.append(f"<|{role if isinstance(role, str) else 'user'}|>")
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                tokens += words(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text", ""), str):
                        tokens += words(part.get("text", ""))
        return tokens
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        tokens = []
        for item in prompt:
            tokens += words(item) if isinstance(item, str) else [str(item)]
        return tokens
    return words(str(prompt))


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
        elif path == "/metrics":
            self._send(200, self.model.metrics.exposition(), CONTENT_TYPE_LATEST)
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
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise BadRequest(400, "'max_tokens' must be a positive integer")
        stall = _stall_of(body)
        if stall and stall[0] == "start":
            self._stall(stall[1])  # before the answer's headers: a connected engine that says nothing
        prompt = _prompt_tokens(body, chat)
        limit = self.model.params.max_model_len
        if len(prompt) + (max_tokens or 1) > limit:
            raise BadRequest(400, (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt) + (max_tokens or 0)} tokens ({len(prompt)} in the messages, {max_tokens or 0} in the "
                "completion). Please reduce the length of the messages or completion."))
        tokens, finish = self.model.tokens(max_tokens)
        engine, metrics = self.model.engine, self.model.metrics
        arrival = time.monotonic()
        try:
            ticket = engine.submit(prompt, len(tokens), arrival)
        except RequestTooLarge as exc:
            raise BadRequest(400, str(exc)) from None
        stream = bool(body.get("stream"))
        generated, answered = 0, False
        try:
            if stream:
                self._stream_start()  # vLLM answers 200 at once, and the events as they come
            while not ticket.admitted.wait(CLIENT_CHECK):
                if self._client_gone():
                    return  # vLLM aborts a request whose client went away; so does the queue
            while (left := ticket.first_token_at - time.monotonic()) > 0:
                if self._client_gone():
                    return
                time.sleep(min(CLIENT_CHECK, left))
            if stall and stall[0] == "first_token":
                self._stall(stall[1])
            engine.computed(ticket)
            metrics.admitted(ticket)  # its first token is out: vLLM observes TTFT now
            usage = {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + len(tokens),
                "completion_tokens": len(tokens),
                "prompt_tokens_details": {"cached_tokens": ticket.cached_tokens},
            }
            ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            if stream:
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

                def pace() -> None:
                    nonlocal generated
                    generated += 1
                    if stall and stall[0] == "token" and generated == stall[2]:
                        self._stall(stall[1])
                    step = engine.decode_step()
                    if step > 0:
                        time.sleep(step)

                self._stream_events(_events(self.model, ident, tokens, finish,
                                            usage if include_usage else None, chat, pace))
                generated, answered = len(tokens), True
                return
            generated = 1 + _decode(engine, len(tokens) - 1, self._client_gone)
            if generated < len(tokens):
                return
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
            answered = True
        finally:
            engine.finish(ticket, time.monotonic(), generated, ok=answered)
            if answered:
                metrics.finished(time.monotonic() - arrival)
            else:
                self.close_connection = True

    def _client_gone(self) -> bool:
        """Whether the client closed its connection (a pipelined next request is not that)."""
        try:
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _stall(self, seconds: float) -> None:
        """Say nothing for ``seconds`` (or until the client goes away)."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0 and not self._client_gone():
            time.sleep(min(CLIENT_CHECK, left))

    def _stream_start(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def _stream_events(self, events: Iterator[dict[str, Any] | None]) -> None:
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


# How often a request that waits (in the queue, for its first token) looks
# whether its client is still there.
CLIENT_CHECK = 1.0
# A non-streamed answer sleeps through its decode steps in slices of about
# this long, reading the running count (and so the step's length) again
# before each: a hundred wake-ups for a thousand tokens, not a thousand.
DECODE_SLICE = 0.05


def _decode(engine: SimEngine, steps: int, gone: Callable[[], bool]) -> int:
    """Sleep through ``steps`` decode steps; the steps done (fewer when the client went away)."""
    done = 0
    while done < steps:
        step = engine.decode_step()
        if step <= 0:
            return steps
        if gone():
            return done
        n = min(steps - done, max(1, int(DECODE_SLICE / step)))
        time.sleep(n * step)
        done += n
    return done


STALL_POINTS = ("start", "first_token", "token")


def _stall_of(body: dict[str, Any]) -> tuple[str, float, int] | None:
    """A test's knob, the body's ``sim_stall``: ``{"at": "start" | "first_token" | "token", "seconds": S,
    "after": N}``: say nothing for S seconds before the answer's headers, before the first token, or after
    the N-th streamed token. Only the sim engine reads it (the gateway's timeout tests stall it there)."""
    stall = body.get("sim_stall")
    if stall is None:
        return None
    if not isinstance(stall, dict) or stall.get("at") not in STALL_POINTS:
        raise BadRequest(400, f"'sim_stall' must be {{\"at\": one of {', '.join(STALL_POINTS)}, \"seconds\": S}}")
    seconds, after = stall.get("seconds", 0), stall.get("after", 1)
    if not isinstance(seconds, (int, float)) or not 0 <= seconds <= 3600 or not isinstance(after, int) or after < 1:
        raise BadRequest(400, "'sim_stall': seconds must be 0-3600 and after a whole number >= 1")
    return stall["at"], float(seconds), after


def _events(model: SimModel, ident: str, tokens: list[str], finish: str, usage: dict | None, chat: bool,
            pace: Callable[[], None]):
    """The SSE events of one streamed completion; None stands for ``[DONE]``.
    ``pace`` waits one decode step before every token after the first."""
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
    for i, token in enumerate(tokens):
        if i:
            pace()
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
