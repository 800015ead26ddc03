"""A real OpenAI-style upstream on 127.0.0.1 whose behaviour a test controls:
it can hold a stream open, hang, die mid-stream, and it records when a
client went away. Runs an aiohttp server on a thread of the test process."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp import web

from tests.conftest import free_port


class FakeEngine:
    def __init__(self, model: str, *, events: int = 5, event_delay: float = 0.0) -> None:
        self.model = model
        self.events = events
        self.event_delay = event_delay
        self.port = free_port()
        self.mode = "normal"  # normal | hold | hang | die_mid_stream | error500 | error503 | split_events
        self.release = threading.Event()  # lets a held stream go on
        self.requests: list[dict] = []
        self.disconnects: list[float] = []
        self.finished_streams = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = threading.Event()
        self._runner: web.AppRunner | None = None

    # --- life -----------------------------------------------------------------------------

    def start(self) -> "FakeEngine":
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("fake engine did not start")
        return self

    def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embeddings)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    # --- handlers ---------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        return web.json_response({"object": "list", "model": self.model,
                                  "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                                  "usage": {"prompt_tokens": 2, "total_tokens": 2}})

    async def _write(self, response: web.StreamResponse, event: bytes) -> None:
        """One event; in ``split_events`` mode in two writes a moment apart, cut inside its JSON (as a
        TCP segment boundary may cut it), so that the gateway reads it in two chunks."""
        if self.mode != "split_events":
            await response.write(event)
            return
        cut = event.find(b'"usage"') + 3 if b'"usage"' in event else len(event) // 2
        await response.write(event[:cut])
        await asyncio.sleep(0.05)
        await response.write(event[cut:])

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"headers": dict(request.headers), **body})
        if self.mode == "hang":
            while not self.release.is_set():
                await asyncio.sleep(0.05)
        if self.mode == "error500":
            return web.json_response({"error": {"message": "engine exploded", "type": "server_error"}}, status=500)
        if self.mode == "error503":
            return web.json_response({"error": {"message": "engine overloaded", "type": "server_error"}}, status=503)
        usage = {"prompt_tokens": 7, "completion_tokens": self.events, "total_tokens": 7 + self.events}
        if not body.get("stream"):
            if self.event_delay:
                await asyncio.sleep(self.event_delay * self.events)
            return web.json_response({
                "id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()), "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi " * self.events},
                             "finish_reason": "stop"}],
                "usage": usage,
            })
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(self.events):
                chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": self.model,
                         "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
                if include_usage:
                    chunk["usage"] = None
                await self._write(response, b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if i == 0 and self.mode == "hold":
                    while not self.release.is_set():
                        await asyncio.sleep(0.02)
                if i == 1 and self.mode == "die_mid_stream":
                    request.transport.abort()
                    return response
                if self.event_delay:
                    await asyncio.sleep(self.event_delay)
            if include_usage:
                final = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": self.model,
                         "choices": [], "usage": usage}
                await self._write(response, b"data: " + json.dumps(final).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            self.finished_streams += 1
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            self.disconnects.append(time.monotonic())
            raise
        return response
