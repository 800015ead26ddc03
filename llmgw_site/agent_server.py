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
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import ssl
import sys
import threading
import time
from functools import partial

from gunicorn import http
from gunicorn import sock as gsock
from gunicorn.workers.gthread import TConn, ThreadWorker

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = float(os.environ.get("LLMGW_AGENT_HANDSHAKE_TIMEOUT", "10"))
REQUEST_TIMEOUT = float(os.environ.get("LLMGW_AGENT_REQUEST_TIMEOUT", "30"))
ALIVE_EVERY = 1.0


class _TimedSSLSocket(ssl.SSLSocket):
    """Blocking reads and writes in pool threads time out instead of hanging."""

    def setblocking(self, flag: bool) -> None:
        if flag:
            self.settimeout(REQUEST_TIMEOUT)
        else:
            super().setblocking(False)


class _VerifiedConn(TConn):
    """A connection whose TLS handshake the main loop already completed."""

    def init(self) -> None:
        if self.initialized:
            return
        self.initialized = True
        self.sock.setblocking(True)
        self.parser = http.get_parser(self.cfg, self.sock, self.client)


class AgentApiWorker(ThreadWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handshaking: dict[_VerifiedConn, int] = {}
        self._context: ssl.SSLContext | None = None

    # --- set-up ---------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        if self._context is None:
            context = gsock.ssl_context(self.cfg)
            context.sslsocket_class = _TimedSSLSocket
            self._context = context
        return self._context

    def run(self) -> None:
        self.ssl_context()
        threading.Thread(target=_listener_alive_loop, name="listener-alive", daemon=True).start()
        super().run()

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
