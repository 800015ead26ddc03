"""The agent API's TLS listener: gunicorn's gthread worker, hardened.

gunicorn is the one server that hands the verified client certificate to the
application (``request.META["gunicorn.socket"]``), so it serves the agent API.
Its gthread worker, as shipped, wraps and handshakes each new connection in a
pool thread with no timeout: a port scanner, a stalled agent or a thousand
agents reconnecting at once can hold every thread while real heartbeats wait.

This worker does the TLS handshake in the main loop, non-blocking, under a
deadline, and hands a connection to a thread only once it is verified and has
bytes to read. A thread reading a request gives up after ``REQUEST_TIMEOUT``.
The SSL context is built once per worker rather than once per connection.

Every agent heartbeats through here, thousands of times a second on two
cores, so the per-request machinery is trimmed too (bench/heartbeats.py
measures it): a whole response goes out as one TLS record with its length
rather than chunked in three, and the thread pool hands connections over a
plain queue instead of a Future, a Condition and a callback list per request.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import selectors
import ssl
import sys
import threading
import time
from collections import deque
from datetime import datetime
from functools import partial

from gunicorn import http, util
from gunicorn import sock as gsock
from gunicorn.http import wsgi
from gunicorn.workers.gthread import TConn, ThreadWorker

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = float(os.environ.get("LLMGW_AGENT_HANDSHAKE_TIMEOUT", "10"))
REQUEST_TIMEOUT = float(os.environ.get("LLMGW_AGENT_REQUEST_TIMEOUT", "30"))
ALIVE_EVERY = 1.0
NOTIFY_EVERY = 1.0


class _TimedSSLSocket(ssl.SSLSocket):
    """Blocking reads and writes in pool threads time out instead of hanging."""

    def setblocking(self, flag: bool) -> None:
        if flag:
            self.settimeout(REQUEST_TIMEOUT)
        else:
            super().setblocking(False)


class _VerifiedConn(TConn):
    """A connection whose TLS handshake the main loop already completed."""

    keepalive = 2.0  # the worker sets --keep-alive here once; cfg lookups are not free

    def init(self) -> None:
        if self.initialized:
            return
        self.initialized = True
        self.sock.setblocking(True)
        self.parser = http.get_parser(self.cfg, self.sock, self.client)

    def set_timeout(self) -> None:
        self.timeout = time.monotonic() + self.keepalive


class _OneWriteResponse(wsgi.Response):
    """gunicorn's response, with the headers held back until the body (or the
    end) so that they leave together: one TLS record and one send per answer
    instead of three (headers, chunk, last chunk), each of which gives up the
    GIL and waits to take it back."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head = b""

    def send_headers(self) -> None:
        if self.headers_sent:
            return
        lines = self.default_headers()
        lines.extend(f"{k}: {v}\r\n" for k, v in self.headers)
        self._head = ("".join(lines) + "\r\n").encode("latin-1")
        self.headers_sent = True

    def _emit_body(self, data: bytes) -> None:
        if self.chunked:
            data = b"%X\r\n%b\r\n" % (len(data), data)
        head, self._head = self._head, b""
        self.sock.sendall(head + data if head else data)

    def write_whole(self, body: bytes) -> None:
        """A body known in full goes out with its length rather than chunked."""
        if self.chunked and not self.headers_sent:
            self.headers.append(("Content-Length", str(len(body))))
            self.response_length = len(body)
            self.chunked = False
        self.write(body)

    def close(self) -> None:
        if not self.headers_sent:
            self.send_headers()
        head, self._head = self._head, b""
        tail = b"0\r\n\r\n" if self.chunked else b""
        if head or tail:
            self.sock.sendall(head + tail)


class _Finished:
    """What ``finish_request`` reads of a finished job (a Future's interface)."""

    __slots__ = ("_result", "_error")

    def __init__(self, result, error: BaseException | None = None) -> None:
        self._result = result
        self._error = error

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return self._error

    def result(self):
        if self._error is not None:
            raise self._error
        return self._result


class _ConnectionPool:
    """Threads taking connections from the main loop and handing them back:
    what gthread's ThreadPoolExecutor did, without the Future, Condition and
    callbacks it built for every request.

    The thread that went idle last takes the next connection (a stack, not a
    queue): at a few requests in flight, the same few threads do all the
    work with their state still in the CPU's caches, while the rest wait for
    a burst. Round-robin over sixteen threads cost a quarter more CPU per
    request (bench/heartbeats.py).
    """

    def __init__(self, worker: "AgentApiWorker", threads: int) -> None:
        self._worker = worker
        self._lock = threading.Lock()
        self._backlog: deque = deque()
        self._idle: list[_PoolSlot] = []
        self._slots = [_PoolSlot() for _ in range(threads)]
        for i, slot in enumerate(self._slots):
            threading.Thread(target=self._serve, args=(slot,), name=f"agent-api-{i}", daemon=True).start()

    def put(self, conn) -> None:
        with self._lock:
            if self._idle:
                slot = self._idle.pop()
                slot.conn = conn
                slot.wake.release()
                return
            self._backlog.append(conn)

    def _next(self, slot: "_PoolSlot"):
        with self._lock:
            if self._backlog:
                return self._backlog.popleft()
            self._idle.append(slot)
        slot.wake.acquire()
        conn, slot.conn = slot.conn, None
        return conn

    def _serve(self, slot: "_PoolSlot") -> None:
        worker = self._worker
        while True:
            conn = self._next(slot)
            if conn is _STOP:
                return
            try:
                result = worker.handle(conn)
            except BaseException as exc:  # noqa: BLE001 - finish_request closes the connection
                worker.method_queue.defer(worker.finish_request, conn, _Finished(None, exc))
                continue
            if result is True and worker.keep_alive_here(conn):
                continue
            worker.method_queue.defer(worker.finish_request, conn, _Finished(result))

    def shutdown(self, wait: bool = False) -> None:
        with self._lock:
            self._backlog.extend(_STOP for _ in self._slots)
            idle, self._idle = self._idle, []
        for slot in idle:
            slot.conn = self._backlog.popleft()
            slot.wake.release()


class _PoolSlot:
    __slots__ = ("wake", "conn")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()  # released by put() when it hands this thread a connection
        self.conn = None


_STOP = object()


class AgentApiWorker(ThreadWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handshaking: dict[_VerifiedConn, int] = {}
        self._context: ssl.SSLContext | None = None
        self._notified_at = float("-inf")

    # --- set-up ---------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        if self._context is None:
            context = gsock.ssl_context(self.cfg)
            context.sslsocket_class = _TimedSSLSocket
            self._context = context
        return self._context

    def notify(self) -> None:
        # gunicorn calls this on every turn of the main loop, and it is a
        # utime() on a file; the arbiter only needs it once per --timeout.
        now = time.monotonic()
        if now - self._notified_at >= NOTIFY_EVERY:
            self._notified_at = now
            super().notify()

    def get_thread_pool(self) -> _ConnectionPool:
        _VerifiedConn.keepalive = float(self.cfg.keepalive)
        return _ConnectionPool(self, self.cfg.threads)

    def run(self) -> None:
        from nodes import liveness

        self.ssl_context()
        liveness.store().serve_heartbeats()
        threading.Thread(target=_listener_alive_loop, name="listener-alive", daemon=True).start()
        # Django, the URLconf and the ORM are loaded for good: keep the
        # collector from walking them again on every full collection, which
        # at a thousand requests a second shows up in the slowest answers.
        gc.collect()
        gc.freeze()
        super().run()

    # --- serving ----------------------------------------------------------------

    def enqueue_req(self, conn) -> None:
        self.tpool.put(conn)

    def keep_alive_here(self, conn) -> bool:
        """In the pool thread that answered: wait for the connection's next
        request on the poller from here, as ``finish_request`` would in the
        main loop, sparing the main loop a wake-up per request (the epoll
        registration is thread-safe; the deque's appends are atomic).

        Only the plain case: anything else (a parked long-poll, bytes already
        buffered, a worker shutting down) goes to ``finish_request``.
        """
        if not self.alive or getattr(conn, "park", None) is not None or conn.parser.unreader.buf.getvalue():
            return False
        try:
            conn.sock.setblocking(False)
            conn.set_timeout()
            self.keepalived_conns.append(conn)
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_client_socket_readable, conn))
        except Exception:  # noqa: BLE001 - let finish_request deal with it in the main loop
            try:
                self.keepalived_conns.remove(conn)
            except ValueError:
                pass
            return False
        return True

    def _cap_keepalive(self, deadline: float) -> None:
        # Pool threads may still append while the worker stops: walk a copy.
        for conn in list(self.keepalived_conns):
            conn.timeout = min(conn.timeout, deadline)

    def handle_request(self, req, conn) -> bool:
        """gthread's ``handle_request`` with ``_OneWriteResponse``, and a
        non-streaming body sent whole with its length."""
        environ: dict = {}
        resp = None
        try:
            self.cfg.pre_request(self, req)
            request_start = datetime.now()
            resp, environ = wsgi.create(
                req, conn.sock, conn.client, conn.server, self.cfg, response_class=_OneWriteResponse
            )
            environ["wsgi.multithread"] = True
            self.nr += 1
            if self.nr >= self.max_requests:
                if self.alive:
                    self.log.info("Autorestarting worker after current request.")
                    self.alive = False
                resp.force_close()
            if not self.alive or not self.cfg.keepalive:
                resp.force_close()
            elif len(self.keepalived_conns) >= self.max_keepalived:
                resp.force_close()

            respiter = self.wsgi(environ, resp.start_response)
            try:
                if isinstance(respiter, environ["wsgi.file_wrapper"]):
                    resp.write_file(respiter)
                elif isinstance(respiter, list) or getattr(respiter, "streaming", True) is False:
                    # A list, or a Django HttpResponse (not a StreamingHttpResponse).
                    resp.write_whole(b"".join(respiter))
                else:
                    for item in respiter:
                        resp.write(item)
                resp.close()
            finally:
                self.log.access(resp, req, environ, datetime.now() - request_start)
                if hasattr(respiter, "close"):
                    respiter.close()
            if resp.should_close():
                return False
        except OSError:
            util.reraise(*sys.exc_info())
        except (Exception, SystemExit):
            if resp and resp.headers_sent and not resp._head:
                # Bytes of this response are on the wire: a 500 now would corrupt it.
                self.log.exception("Error handling request")
                util.close_graceful(conn.sock)
                raise StopIteration()
            raise
        finally:
            try:
                self.cfg.post_request(self, req, environ, resp)
            except Exception:  # noqa: BLE001 - as gthread: a hook's failure is logged, not served
                self.log.exception("Exception in post_request hook")
        return True

    # --- accepting and handshaking ----------------------------------------------

    def accept(self, listener) -> None:
        try:
            client_sock, client_addr = listener.accept()
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        client_sock.setblocking(False)
        try:
            tls = self.ssl_context().wrap_socket(
                client_sock,
                server_side=True,
                do_handshake_on_connect=False,
                suppress_ragged_eofs=self.cfg.suppress_ragged_eofs,
            )
        except OSError:
            self.nr_conns -= 1
            client_sock.close()
            return
        conn = _VerifiedConn(self.cfg, tls, client_addr, listener.getsockname())
        conn.timeout = time.monotonic() + HANDSHAKE_TIMEOUT
        self._handshake_step(conn)

    def _handshake_step(self, conn: _VerifiedConn, _fileobj=None) -> None:
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._handshake_wait(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._handshake_wait(conn, selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError) as exc:
            # No certificate, another authority, an expired certificate, a
            # scanner: the handshake is the refusal.
            self.log.info("agent-api tls handshake refused from %s: %s", _peer(conn), exc)
            self._handshake_drop(conn)
            return
        if self.handshaking.pop(conn, None) is not None:
            self.poller.unregister(conn.sock)
        conn.timeout = time.monotonic() + self.cfg.keepalive
        if conn.sock.pending():
            conn.data_ready = True
            self.enqueue_req(conn)
            return
        # Verified, but nothing to read yet: wait on the poller, not a thread.
        self.pending_conns.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_pending_socket_readable, conn))

    def _handshake_wait(self, conn: _VerifiedConn, events: int) -> None:
        callback = partial(self._handshake_step, conn)
        if conn in self.handshaking:
            if self.handshaking[conn] != events:
                self.poller.modify(conn.sock, events, callback)
        else:
            self.poller.register(conn.sock, events, callback)
        self.handshaking[conn] = events

    def _handshake_drop(self, conn: _VerifiedConn) -> None:
        if self.handshaking.pop(conn, None) is not None:
            try:
                self.poller.unregister(conn.sock)
            except (OSError, KeyError, ValueError):
                pass
        self.nr_conns -= 1
        try:
            conn.sock.close()
        except OSError:
            pass

    def murder_pending(self) -> None:
        super().murder_pending()
        now = time.monotonic()
        for conn in [c for c in self.handshaking if c.timeout <= now]:
            self.log.info("agent-api tls handshake from %s timed out", _peer(conn))
            self._handshake_drop(conn)


def _peer(conn: TConn) -> str:
    try:
        host, port = conn.client[:2]
        return f"{host}:{port}"
    except (TypeError, ValueError):
        return str(conn.client)


def _listener_alive_loop() -> None:
    """Tell the lost-node sweep that the agent API is up and can hear nodes."""
    from nodes import liveness

    failing = False
    while True:
        try:
            liveness.store().mark_listener_alive(time.time())
            if failing:
                logger.info("agent-api liveness store reachable again")
            failing = False
        except Exception as exc:  # noqa: BLE001 - keep the loop alive whatever the store does
            if not failing:
                logger.warning("agent-api cannot write its liveness mark: %s", exc)
            failing = True
        time.sleep(ALIVE_EVERY)


def gunicorn_argv(
    *,
    host: str,
    port: int,
    certfile: str,
    keyfile: str,
    cafile: str,
    workers: int = 2,
    threads: int = 16,
) -> list[str]:
    """The command line that serves the agent API."""
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "llmgw_site.agent_wsgi:application",
        "--bind",
        f"{host}:{port}",
        "--worker-class",
        "llmgw_site.agent_watch.AgentApiWatchWorker",
        "--workers",
        str(workers),
        "--threads",
        str(threads),
        # Above the cluster's size: every agent keeps a connection open.
        "--worker-connections",
        "10000",
        # Longer than the heartbeat interval, so heartbeats reuse their TLS session.
        "--keep-alive",
        "75",
        "--certfile",
        os.path.abspath(certfile),
        "--keyfile",
        os.path.abspath(keyfile),
        "--ca-certs",
        os.path.abspath(cafile),
        "--cert-reqs",
        str(int(ssl.CERT_REQUIRED)),
        "--no-control-socket",
        "--graceful-timeout",
        "5",
        *(["--access-logfile", "-"] if os.environ.get("LLMGW_AGENT_ACCESS_LOG") else []),
        "--error-logfile",
        "-",
        "--log-level",
        os.environ.get("LLMGW_AGENT_LOG_LEVEL", "info"),
    ]
