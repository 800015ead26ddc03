"""The agent API's commonest requests, answered in the worker's event loop.

Nearly every request an agent sends is a heartbeat that brings no news. The
whole way (a pool thread, gunicorn's parser and WSGI environ, Django's
handler, its signals and URL resolver, the view, ``JsonResponse``) cost about
0.6 ms of server CPU for one, of which the answer itself (a dictionary
lookup) is a small part; at 2,000 heartbeats a second that is more than the
machine's two cores can give beside everything else (docs/benchmarks.md).

Here, once ``intake`` has a request whole, a request in a narrow and plainly
valid shape is answered at once from the event loop:

- ``POST /agent/v1/nodes/<id>/heartbeat`` whose answer is the 200 from this
  process's cache (``nodes.api.agent_views.heartbeat_quick``: the
  certificate's CN is the node, its serial is not revoked in a fresh copy,
  the body is the heartbeat the node's cached state was built from, no
  telemetry block);
- ``GET /agent/v1/ping``;

each as HTTP/1.1 with only the headers an agent sends (``_HEADERS``), in
printable ASCII, nothing after it in the buffer. Everything else (another
path or method, any other header, a query string, a refusal, news, Redis or
the revoked serials' copy not fresh, a response that cannot leave in one
non-blocking send) goes the whole way, which answers it as before: the
quick lane declines before it records anything. Its answers are the bytes
the whole way gives (tests/agentapi/test_quick.py compares them).

Not run when gunicorn would do more per request than answer it: an access
log, ``pre_request``/``post_request`` hooks, or keep-alive off
(``quick_lane_allowed``). Django's request signals do not fire for these
requests: their receivers close database connections, and none is used.
"""

from __future__ import annotations

import re
import time

from gunicorn import SERVER
from gunicorn.util import http_date

from nodes.api.agent_views import heartbeat_quick, ping_quick
from pki.authn import PeerIdentity

_REQUEST_LINE = re.compile(
    rb"POST /agent/v1/nodes/([a-z0-9][a-z0-9.-]{0,62})/heartbeat HTTP/1\.1|GET /agent/v1/ping HTTP/1\.1"
)
# What httpx (the agent) and the benchmark send; any other header goes the whole way.
_HEADERS = frozenset(
    {b"host", b"content-type", b"content-length", b"accept", b"accept-encoding", b"user-agent", b"connection"}
)
_VALUE = re.compile(rb"[\x20-\x7e]*")
_MAX_LINE = 1024
_MAX_LINES = 16


def parse(data: bytes) -> tuple[str | None, bytes] | None:
    """(node id, body) of a heartbeat, (None, b"") of a ping, when ``data`` is
    exactly one such request in the narrow shape; else None."""
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    lines = data[:head_end].split(b"\r\n")
    if len(lines) > _MAX_LINES:
        return None
    match = _REQUEST_LINE.fullmatch(lines[0])
    if match is None:
        return None
    length = None
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        name = name.lower()
        if not colon or name not in _HEADERS or len(line) > _MAX_LINE:
            return None
        value = value.strip(b" ")
        if not _VALUE.fullmatch(value):
            return None
        if name == b"content-length":
            if length is not None or not value.isdigit() or len(value) > 9:
                return None
            length = int(value)
        elif name == b"connection" and value.lower() != b"keep-alive":
            return None
    body = data[head_end + 4:]
    node = match[1]
    if node is None:  # the ping
        return (None, b"") if not body and not length else None
    if length is None or len(body) != length:
        return None
    return node.decode("ascii"), body


_date = (0, "")


def _http_date() -> str:
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, http_date(now))
    return _date[1]


def answer(peer: PeerIdentity | None, data: bytes) -> bytes | None:
    """The whole response to ``data`` from the verified ``peer``, or None: the
    whole way answers it."""
    if peer is None:
        return None
    parsed = parse(data)
    if parsed is None:
        return None
    node, body = parsed
    payload = ping_quick(peer=peer) if node is None else heartbeat_quick(node_id=node, peer=peer, body=body)
    if payload is None:
        return None
    head = (
        f"HTTP/1.1 200 OK\r\nServer: {SERVER}\r\nDate: {_http_date()}\r\nConnection: keep-alive\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode("latin-1") + payload


def quick_lane_allowed(cfg) -> bool:
    """Whether gunicorn would do nothing per request but answer it."""
    hooks = all(cfg.settings[name].get() is type(cfg.settings[name]).default for name in ("pre_request", "post_request"))
    return hooks and not cfg.accesslog and bool(cfg.keepalive)
