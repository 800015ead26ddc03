"""The gunicorn internals the agent API's worker class overrides or reaches
into, checked against the gunicorn installed (the version pinned in
requirements.txt).

agentapi/ subclasses gthread's ThreadWorker, TConn and wsgi.Response,
replaces the ThreadPoolExecutor gthread hands connections to, reads each
request in the event loop before gthread's ``handle`` sees it, and fills the
parser's buffer with it. None of that is gunicorn's public API: a gunicorn upgrade may
rename a method (ours would then never be called), change its arguments
(ours would then be called wrongly), or drop an attribute. Each test here
fails with the name of what changed; read the new gunicorn's gthread.py and
http/wsgi.py, and bring agentapi/ in line before moving the pin.
"""

from __future__ import annotations

import ast
import inspect
import socket
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from gunicorn import http, util
from gunicorn import sock as gsock
from gunicorn.config import Config
from gunicorn.http import wsgi
from gunicorn.workers import base as gbase
from gunicorn.workers import gthread
from gunicorn.workers.gthread import TConn, ThreadWorker

from agentapi.parking import AgentApiParkingWorker
from agentapi.pool import ConnectionPool
from agentapi.response import OneWriteResponse
from agentapi.worker import AgentApiWorker, VerifiedConn

# Every method of ours that replaces one of gunicorn's, by class.
OVERRIDES = {
    AgentApiWorker: ["__init__", "notify", "get_thread_pool", "run", "enqueue_req", "handle", "handle_request",
                     "_cap_keepalive", "accept", "murder_pending"],
    AgentApiParkingWorker: ["__init__", "run", "handle", "handle_request", "finish_request", "murder_pending"],
    VerifiedConn: ["__init__", "init", "set_timeout", "close"],
    OneWriteResponse: ["__init__", "send_headers", "_emit_body", "close"],
}

# Methods of gunicorn's that ours call without overriding them, by class.
CALLED = {
    ThreadWorker: ["handle", "handle_request", "finish_request", "_keepalive_after", "on_client_socket_readable",
                   "on_pending_socket_readable", "murder_pending", "notify", "run"],
    TConn: ["__init__"],
    wsgi.Response: ["default_headers", "write", "write_file", "should_close", "force_close", "start_response"],
}

# The gunicorn code that must still call each hook of ours, or it is dead.
HOOK_CALLERS = {
    "notify": ThreadWorker.run,
    "get_thread_pool": ThreadWorker.init_process,
    "enqueue_req": ThreadWorker.on_client_socket_readable,
    "handle_request": ThreadWorker.handle,
    "_cap_keepalive": ThreadWorker.run,
    "murder_pending": ThreadWorker.run,
    "finish_request": ThreadWorker.enqueue_req,
    "handle": ThreadWorker.enqueue_req,
    "init": ThreadWorker.handle,
    "set_timeout": ThreadWorker.finish_request,
    "_emit_body": wsgi.Response.write,
    "send_headers": wsgi.Response.write,
    "close": ThreadWorker.handle_request,
}


def _gunicorn_class_defining(cls: type, name: str) -> type | None:
    return next((base for base in cls.__mro__[1:] if name in vars(base) and base.__module__.startswith("gunicorn")),
                None)


def _shape(function) -> list[tuple[str, object, object]]:
    """Names, kinds and defaults of the parameters (annotations differ: ours are typed)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def _passes_everything_on(function) -> bool:
    kinds = {p.kind for p in inspect.signature(function).parameters.values()}
    return {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds


def _attributes_used(function) -> set[str]:
    """Every ``something.X`` in ``function``'s source, called or handed on."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def _calls_on(function, receiver: str) -> set[str]:
    """``receiver.X(...)`` calls in ``function``'s source, e.g. ``self.tpool`` or ``fs``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and ast.unparse(node.func.value) == receiver
    }


@pytest.mark.parametrize(
    ("cls", "name"), [(cls, name) for cls, names in OVERRIDES.items() for name in names],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_each_override_replaces_a_gunicorn_method_of_the_same_signature(cls, name):
    parent = _gunicorn_class_defining(cls, name)
    assert parent is not None, (
        f"gunicorn no longer defines {name}(): {cls.__name__}.{name} would never be called"
    )
    ours = vars(cls)[name]
    if _passes_everything_on(ours):
        return  # (*args, **kwargs) handed to super(): any signature of the parent's fits
    assert _shape(ours) == _shape(vars(parent)[name]), (
        f"{parent.__module__}.{parent.__name__}.{name} changed signature: "
        f"{inspect.signature(vars(parent)[name])}, ours is {inspect.signature(ours)}"
    )


@pytest.mark.parametrize("cls", list(OVERRIDES), ids=lambda c: c.__name__)
def test_every_method_of_ours_that_shadows_gunicorns_is_listed_here(cls):
    shadowing = {
        name for name, value in vars(cls).items()
        if callable(value) and not name.startswith("__") and _gunicorn_class_defining(cls, name) is not None
    }
    assert shadowing <= set(OVERRIDES[cls]), f"add {sorted(shadowing - set(OVERRIDES[cls]))} to OVERRIDES"


@pytest.mark.parametrize(
    ("cls", "name"), [(cls, name) for cls, names in CALLED.items() for name in names],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_gunicorn_methods_we_call_still_exist(cls, name):
    assert callable(getattr(cls, name, None)), f"{cls.__module__}.{cls.__name__}.{name} is gone"


def test_the_signatures_we_call_gunicorns_methods_with():
    bind = lambda f, *a, **k: inspect.signature(f).bind(*a, **k)  # noqa: E731 - TypeError names the mismatch
    bind(ThreadWorker.handle_request, "self", "req", "conn")
    bind(ThreadWorker.finish_request, "self", "conn", "fs")
    bind(ThreadWorker.handle, "self", "conn")
    bind(ThreadWorker._keepalive_after, "self", "conn", True)
    bind(ThreadWorker.on_client_socket_readable, "self", "conn", "client")
    bind(ThreadWorker.on_pending_socket_readable, "self", "conn", "client")
    bind(TConn, "cfg", "sock", "client", "server")
    bind(wsgi.create, "req", "sock", "client", "server", "cfg", response_class=OneWriteResponse)
    bind(wsgi.Response, "req", "sock", "cfg")
    bind(http.get_parser, "cfg", "sock", "client")
    bind(gsock.ssl_context, "cfg")
    bind(util.close_graceful, "sock")
    bind(util.reraise, None, None, None)


@pytest.mark.parametrize("hook", sorted(HOOK_CALLERS))
def test_gunicorn_still_calls_each_hook_we_override(hook):
    caller = HOOK_CALLERS[hook]
    assert hook in _attributes_used(caller), f"{caller.__qualname__} no longer calls {hook}(): ours would be dead"


def test_the_thread_pool_is_used_only_as_our_pool_allows():
    """gthread hands connections to ``self.tpool``; ours replaces it (and
    ``enqueue_req``, the one place gthread submits work)."""
    uses = {
        name: _calls_on(function, "self.tpool")
        for name, function in vars(ThreadWorker).items()
        if inspect.isfunction(function) and _calls_on(function, "self.tpool")
    }
    assert uses == {"enqueue_req": {"submit"}, "handle_quit": {"shutdown"}, "run": {"shutdown"}}, uses
    assert "enqueue_req" in vars(AgentApiWorker)
    assert set(_shape(ConnectionPool.shutdown)[1:]) <= set(_shape(ThreadPoolExecutor.shutdown)[1:]) | {
        ("wait", inspect.Parameter.POSITIONAL_OR_KEYWORD, False)
    }


def test_finish_request_is_handed_a_real_future():
    read = _calls_on(ThreadWorker.finish_request, "fs")
    assert read <= set(vars(Future)), read
    assert "Future()" in inspect.getsource(ConnectionPool._serve)


def test_worker_attributes_we_read_exist_on_a_real_thread_worker(tmp_path):
    cfg = Config()
    cfg.set("worker_tmp_dir", str(tmp_path))
    worker = ThreadWorker(0, 0, [], None, 30, cfg, None)
    for name in ("cfg", "nr", "max_requests", "alive", "log", "tpool", "method_queue", "keepalived_conns",
                 "pending_conns", "nr_conns", "max_keepalived"):
        assert hasattr(worker, name), f"ThreadWorker has no attribute {name!r}"
    assert callable(worker.method_queue.defer)
    assert inspect.signature(gthread.PollableMethodQueue.defer).bind("self", "callback", "conn", "fs")
    # poller and wsgi are set when the worker starts (init_process, load_wsgi).
    assert "self.poller = " in inspect.getsource(ThreadWorker.init_process)
    assert "self.wsgi = " in inspect.getsource(gbase.Worker.load_wsgi)
    for name in ("keepalive", "threads", "suppress_ragged_eofs", "pre_request", "post_request"):
        assert hasattr(cfg, name), f"gunicorn's Config has no {name!r}"


def test_a_real_parser_and_connection_have_what_we_read():
    cfg = Config()
    server, client = socket.socketpair()
    try:
        conn = VerifiedConn(cfg, server, ("127.0.0.1", 40000), ("127.0.0.1", 7443))
        for name in ("initialized", "data_ready", "timeout", "parser", "sock", "client", "server", "cfg"):
            assert hasattr(conn, name), f"TConn has no attribute {name!r}"
        # The parking worker keeps its own state on the connection.
        conn.park = conn.parked = conn.resume_req = None
        # The event loop (intake.py) puts a whole request, and what follows
        # it, in the parser's buffer; a thread then parses from there.
        pipelined = b"GET /agent/v1/ping HTTP/1.1\r\nHost: x\r\n"
        conn.buffered_parser().unreader.unread(
            b"GET /agent/v1/nodes/node01/desired?wait=30 HTTP/1.1\r\nHost: x\r\n\r\n" + pipelined
        )
        conn.init()
        req = next(conn.parser)
        assert (req.method, req.path, req.query) == ("GET", "/agent/v1/nodes/node01/desired", "wait=30")
        assert conn.parser.finish_body(deadline=0.0)
        assert conn.parser.unreader.take_buffered() == pipelined
        assert conn.parser.unreader.buf.getvalue() == b""
    finally:
        server.close()
        client.close()


def test_the_parser_of_a_connection_never_reads_its_socket():
    """A request the event loop misjudged as whole ends the parser's input:
    the thread gets NoMoreData at once, however much the socket holds."""
    cfg = Config()
    server, client = socket.socketpair()
    try:
        conn = VerifiedConn(cfg, server, ("127.0.0.1", 40000), ("127.0.0.1", 7443))
        client.sendall(b"Host: x\r\n\r\n")  # the rest of the head, on the socket only
        conn.buffered_parser().unreader.unread(b"GET /agent/v1/ping HTTP/1.1\r\n")
        conn.init()
        assert not hasattr(conn.parser.unreader, "sock")
        with pytest.raises(http.errors.NoMoreData):
            next(conn.parser)
        body = b'{"a": 1}'
        conn.parser = None
        conn.buffered_parser().unreader.unread(
            b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body) + 5, body)
        )
        req = next(conn.parser)
        assert req.body.read() == body  # the rest never came: the body ends where the buffer does
    finally:
        server.close()
        client.close()


def test_every_way_gthread_hands_a_connection_to_a_thread_goes_through_enqueue_req():
    """Our enqueue_req reads the request in the event loop first; a path that
    submitted to the pool without it would let a thread wait on a client."""
    for caller in (ThreadWorker.on_client_socket_readable, ThreadWorker.on_pending_socket_readable,
                   ThreadWorker.finish_request):
        assert "enqueue_req" in _calls_on(caller, "self"), caller.__qualname__
    assert {"accept"} <= set(vars(AgentApiWorker))  # gthread's accept submits directly: ours replaces it
    # A connection handed over with its request read skips gthread's wait for data.
    assert "conn.data_ready" in inspect.getsource(ThreadWorker.handle)
    assert "take_buffered" in vars(http.unreader.Unreader) and "unread" in vars(http.unreader.Unreader)


def test_gunicorn_closes_connections_through_conn_close():
    """VerifiedConn.close gives back the certificate's connection slot, and
    turns a graceful close into a non-blocking linger in the event loop."""
    assert "close" in _calls_on(ThreadWorker.finish_request, "conn")
    assert "graceful=True" in inspect.getsource(ThreadWorker.finish_request)
    for caller in (ThreadWorker.murder_keepalived, ThreadWorker.murder_pending):
        assert "close" in _calls_on(caller, "conn"), caller.__qualname__
    assert _shape(TConn.close) == _shape(VerifiedConn.close)


class _Sends:
    """A socket that records what is sent, send by send."""

    def __init__(self) -> None:
        self.sends: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.sends.append(bytes(data))

    send = sendall


def _response(cfg: Config) -> tuple[OneWriteResponse, _Sends]:
    server, client = socket.socketpair()
    try:
        client.sendall(b"GET /agent/v1/ping HTTP/1.1\r\nHost: x\r\n\r\n")
        req = next(http.get_parser(cfg, server, ("127.0.0.1", 40000)))
    finally:
        server.close()
        client.close()
    sock = _Sends()
    return OneWriteResponse(req, sock, cfg), sock


def test_one_write_response_goes_out_in_one_send_through_gunicorns_write():
    cfg = Config()
    resp, sock = _response(cfg)
    resp.start_response("200 OK", [("Content-Type", "application/json")])
    resp.write_whole(b'{"ok": true}')
    resp.close()
    assert len(sock.sends) == 1, sock.sends
    head, _, body = sock.sends[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Length: 12" in head
    assert body == b'{"ok": true}'

    streamed, sock = _response(cfg)
    streamed.start_response("200 OK", [("Content-Type", "text/plain")])
    streamed.write(b"hello")
    streamed.close()
    assert len(sock.sends) == 2, sock.sends  # headers with the first chunk, then the last chunk
    assert b"Transfer-Encoding: chunked" in sock.sends[0] and sock.sends[0].endswith(b"\r\n5\r\nhello\r\n")
    assert sock.sends[1] == b"0\r\n\r\n"
