"""What the gateway needs from a request body, parsed where it cannot stall
the event loop.

``json.loads`` holds the GIL for the whole parse: a thread does not help (a
32 MiB body of small objects held the loop for over a second even from a
worker thread), and the parsed objects of one such body take ~30 times its
size. Bodies above a small size are therefore parsed in a separate process,
which answers with the few facts the gateway routes on (``Checked``), never
with the parsed objects; at most ``workers`` such parses run at once per web
process, so their memory is bounded too.

This module imports nothing from Django: the parsing processes import it alone.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from .prefix import prompt_blocks, prompt_text


@dataclass(frozen=True)
class Hashing:
    models: frozenset[str]
    block_chars: int
    max_blocks: int


@dataclass(frozen=True)
class Checked:
    """A body's verdict. ``problem`` is (param, message) when it is refused;
    ``body`` is the bytes to forward when they had to change (None: as sent)."""

    model: str = ""
    stream: bool = False
    strip_usage: bool = False
    problem: tuple[str | None, str] | None = None
    body: bytes | None = None
    # The prompt's prefix blocks (gateway.prefix), for a model routed by cache only.
    blocks: tuple[int, ...] = ()
    prompt_chars: int = 0  # the length of the text the blocks were cut from
    user: str | None = None  # the body's "user": a session key
    max_tokens: int | None = None  # what the body asks for at most (max_completion_tokens or max_tokens)


def check(raw: bytes, required: str, streams: bool, hashing: Hashing | None = None) -> Checked:
    """Parse and check a /v1 body; ``streams`` is False for endpoints that never stream;
    ``hashing``: the models whose prompts are cut into prefix blocks, and how."""
    try:
        body = json.loads(raw)
    except RecursionError:
        return Checked(problem=(None, "The body is nested too deeply: JSON nesting is limited to well under "
                                      f"{_depth_limit()} levels."))
    except (ValueError, UnicodeDecodeError) as exc:
        return Checked(problem=(None, f"The body is not valid JSON: {exc}"))
    problem = _problem(body, required)
    if problem:
        return Checked(problem=problem)
    stream = streams and body.get("stream") is True
    strip_usage = stream and ask_for_usage(body)
    model = body["model"]
    blocks: tuple[int, ...] = ()
    chars = 0
    if hashing is not None and model in hashing.models:
        text = prompt_text(body)
        if text:
            blocks = prompt_blocks(text, hashing.block_chars, hashing.max_blocks)
            chars = len(text)
    user = body.get("user")
    most = body.get("max_completion_tokens", body.get("max_tokens"))
    return Checked(model=model, stream=stream, strip_usage=strip_usage,
                   body=encode(body) if strip_usage else None, blocks=blocks, prompt_chars=chars,
                   user=user if isinstance(user, str) and user else None,
                   max_tokens=most if type(most) is int else None)


def _depth_limit() -> int:
    import sys

    return sys.getrecursionlimit()


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


def ask_for_usage(body: dict) -> bool:
    """Make a streamed request end with a usage event; True when the client
    did not ask for one (the gateway then counts it and drops it)."""
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False
    body["stream_options"] = {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
    return True


def encode(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """A parsing process's initializer: it goes when the web process goes.

    A pool worker waits on a queue whose writing end it holds itself, so it
    never sees the web process die; when that process is killed (SIGKILL, the
    OOM killer) nothing shuts the pool down and the workers would live on with
    parent 1. On Linux the kernel sends SIGKILL on the parent's death
    (PR_SET_PDEATHSIG: strictly, on the death of the thread that started the
    worker, which is the web process's event loop thread, alive as long as it
    is); elsewhere a thread watches the parent. Either way, a parent already
    gone before this ran is noticed by its pid.
    """
    armed = False
    if sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:
        os._exit(0)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="watch-parent").start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        threading.Event().wait(1.0)
    os._exit(0)


class Checker:
    """Checks small bodies inline and large ones in a pool of processes
    (started on first use, with ``spawn``: the web process has threads)."""

    def __init__(self, *, inline_bytes: int, workers: int) -> None:
        self.inline_bytes = inline_bytes
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    async def check(self, raw: bytes, required: str, streams: bool, hashing: Hashing | None = None) -> Checked:
        if len(raw) <= self.inline_bytes:
            return check(raw, required, streams, hashing)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.workers,
                                             mp_context=multiprocessing.get_context("spawn"),
                                             initializer=die_with_parent, initargs=(os.getpid(),))
        return await asyncio.get_running_loop().run_in_executor(self._pool, check, raw, required, streams, hashing)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
