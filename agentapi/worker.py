"""The agent API's TLS listener: gunicorn's gthread worker, hardened.

gunicorn is the one server that hands the verified client certificate to the
application (``request.META["gunicorn.socket"]``), so it serves the agent API.
Its gthread worker, as shipped, wraps and handshakes each new connection in a
pool thread with no timeout: a port scanner, a stalled agent or a thousand
agents reconnecting at once can hold every thread while real heartbeats wait.

This worker does the TLS handshake in the main loop, non-blocking, under a
deadline (``LLMGW_AGENT_HANDSHAKE_TIMEOUT``); refuses there a revoked
certificate, or one that already holds its share of connections
(``peers.py``); reads each request whole in the main loop, under a deadline
(``intake.py``); and only then hands the connection to a thread, which never
waits on the client to read. The SSL context is built once per worker rather
than once per connection.

Every agent heartbeats through here, thousands of times a second on two
cores, so the per-request machinery is trimmed too (bench/heartbeats.py
measures it): a whole response goes out as one TLS record with its length
rather than chunked in three (``response.py``), and the thread pool hands
connections over a plain queue instead of a Future, a Condition and a
callback list per request (``pool.py``); a connection kept alive goes back
to the poller from the thread that answered it.
"""

from __future__ import annotations

import errno
import gc
import logging
import selectors
import ssl
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from functools import partial

from django.conf import settings
from gunicorn import http, util
from gunicorn import sock as gsock
from gunicorn.http import wsgi
from gunicorn.workers.gthread import TConn, ThreadWorker

from nodes import liveness
from pki.authn import PeerIdentity
from pki.selectors import revoked_serials

from .background import release_database_connection
from .framing import Framing
from .intake import Intake
from .peers import PeerGate, keep_fresh
from .pool import ConnectionPool
from .quick import answer, quick_lane_allowed
from .response import OneWriteResponse

logger = logging.getLogger(__name__)

ALIVE_EVERY = 1.0
NOTIFY_EVERY = 1.0


class TimedSSLSocket(ssl.SSLSocket):
    """Blocking writes in pool threads time out instead of hanging."""

    request_timeout: float  # LLMGW_AGENT_REQUEST_TIMEOUT, set by AgentApiWorker.run()

    def setblocking(self, flag: bool) -> None:
        if flag:
            self.settimeout(self.request_timeout)
        else:
            super().setblocking(False)


# The parser's source: it reads only what the event loop put in its buffer,
# and an empty source past that (the end of input, never a wait).
_NO_SOCKET = ()


class VerifiedConn(TConn):
    """A connection whose TLS handshake the main loop already completed."""

    keepalive = 75.0  # LLMGW_AGENT_IDLE_TIMEOUT, set by the worker; cfg lookups are not free

    def __init__(self, cfg, sock, client, server) -> None:
        super().__init__(cfg, sock, client, server)
        self.inbuf = bytearray()
        self.framing: Framing | None = None
        self.request_deadline = 0.0
        self.peer: PeerIdentity | None = None
        self.peers: PeerGate | None = None
        self.linger: Callable[[VerifiedConn], None] | None = None
        self.unsent = b""  # a quick answer a non-blocking send could not take

    def name(self) -> str:
        if self.peer is None:
            return _peer(self)
        return f"{_peer(self)} cn={self.peer.common_name} serial={self.peer.serial}"

    def buffered_parser(self):
        if self.parser is None:
            self.parser = http.get_parser(self.cfg, _NO_SOCKET, self.client)
        return self.parser

    def init(self) -> None:
        if self.initialized:
            return
        self.initialized = True
        self.sock.setblocking(True)
        self.buffered_parser()

    def set_timeout(self) -> None:
        self.timeout = time.monotonic() + self.keepalive

    def close(self, graceful: bool = False) -> None:
        if self.peer is not None and self.peers is not None:
            peers, self.peers = self.peers, None
            peers.release(self.peer.serial)
        if graceful and self.linger is not None:
            linger, self.linger = self.linger, None
            linger(self)
            return
        util.close(self.sock)


class AgentApiWorker(ThreadWorker):
    handshake_timeout: float  # LLMGW_AGENT_HANDSHAKE_TIMEOUT, set by run()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handshaking: dict[VerifiedConn, int] = {}
        self.intake: Intake | None = None
        self.peers: PeerGate | None = None
        self._context: ssl.SSLContext | None = None
        self._notified_at = float("-inf")
        self.quick = False

    # --- set-up ---------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        if self._context is None:
            context = gsock.ssl_context(self.cfg)
            context.sslsocket_class = TimedSSLSocket
            self._context = context
        return self._context

    def notify(self) -> None:
        # gunicorn calls this on every turn of the main loop, and it is a
        # utime() on a file; the arbiter only needs it once per --timeout.
        now = time.monotonic()
        if now - self._notified_at >= NOTIFY_EVERY:
            self._notified_at = now
            super().notify()

    def get_thread_pool(self) -> ConnectionPool:
        return ConnectionPool(self, self.cfg.threads)

    def run(self) -> None:
        self.handshake_timeout = settings.LLMGW_AGENT_HANDSHAKE_TIMEOUT
        TimedSSLSocket.request_timeout = settings.LLMGW_AGENT_REQUEST_TIMEOUT
        VerifiedConn.keepalive = settings.LLMGW_AGENT_IDLE_TIMEOUT
        self.intake = Intake(
            self,
            request_timeout=settings.LLMGW_AGENT_REQUEST_TIMEOUT,
            max_body=settings.LLMGW_MAX_HEARTBEAT_BYTES,
        )
        self.peers = PeerGate(per_cert=settings.LLMGW_AGENT_CONNECTIONS_PER_CERT, revoked=revoked_serials.cached)
        try:
            revoked_serials.get()
        except Exception as exc:  # noqa: BLE001 - serve; keep_fresh retries, and the views check again
            self.log.warning("agent-api cannot read revoked certificates yet: %s", exc)
        threading.Thread(
            target=keep_fresh, args=(revoked_serials.get, settings.LLMGW_REVOCATION_CACHE_SECONDS),
            name="revocations", daemon=True,
        ).start()
        self.ssl_context()
        self.quick = quick_lane_allowed(self.cfg)
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
        """Every connection gunicorn would hand to a thread (readable after the
        handshake, kept alive, or with bytes left over) is read here first;
        ``intake`` hands it on once its request is whole."""
        self.intake.read(conn)

    def answer_quickly(self, conn: VerifiedConn, data: bytes) -> bool:
        """In the main loop: answer a whole request from here (``quick.py``)
        and wait for the connection's next one, as a pool thread would.
        False, having done nothing, when the request goes the whole way."""
        if (not self.quick or not self.alive or self.nr + 1 >= self.max_requests
                or len(self.keepalived_conns) >= self.max_keepalived):
            return False  # the whole way closes, or restarts the worker, as gthread does
        try:
            response = answer(conn.peer, data)
        except Exception:  # noqa: BLE001 - a bug here must not cost the agent its answer
            self.log.exception("agent-api quick answer failed; answering the whole way")
            return False
        if response is None:
            return False
        self.nr += 1
        try:
            conn.sock.send(response)  # non-blocking: one TLS record, whole or not at all
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
            # The client is not reading: a pool thread sends it, under the request deadline.
            conn.unsent = response
            conn.data_ready = True
            self.tpool.put(conn)
            return True
        except OSError as exc:
            self.log.debug("agent-api quick answer to %s not sent: %s", conn.name(), exc)
            self.nr_conns -= 1
            conn.close()
            return True
        conn.set_timeout()
        self.keepalived_conns.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_client_socket_readable, conn))
        return True

    def handle(self, conn):
        unsent = conn.unsent
        if not unsent:
            return super().handle(conn)
        conn.unsent = b""
        conn.buffered_parser()  # what finish_request and keep_alive_here look at
        try:
            conn.sock.setblocking(True)  # a TimedSSLSocket: a write times out
            conn.sock.sendall(unsent)
        except OSError as exc:
            self.log.debug("agent-api quick answer to %s not sent: %s", conn.name(), exc)
            return False
        return True

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
        """gthread's ``handle_request`` with ``OneWriteResponse``, and a
        non-streaming body sent whole with its length."""
        environ: dict = {}
        resp = None
        try:
            self.cfg.pre_request(self, req)
            request_start = datetime.now()
            resp, environ = wsgi.create(
                req, conn.sock, conn.client, conn.server, self.cfg, response_class=OneWriteResponse
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
            if resp and resp.headers_sent and not resp.held_head:
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
        conn = VerifiedConn(self.cfg, tls, client_addr, listener.getsockname())
        conn.timeout = time.monotonic() + self.handshake_timeout
        self._handshake_step(conn)

    def _handshake_step(self, conn: VerifiedConn, _fileobj=None) -> None:
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
        try:
            der = conn.sock.getpeercert(binary_form=True)
        except (OSError, ValueError):
            der = None
        conn.peer = self.peers.admit(der, peer=_peer(conn))
        if conn.peer is None:
            self._handshake_drop(conn)
            return
        conn.peers = self.peers
        conn.linger = self.intake.linger
        conn.timeout = time.monotonic() + conn.keepalive
        if conn.sock.pending():
            conn.data_ready = True
            self.enqueue_req(conn)
            return
        # Verified, but nothing to read yet: wait on the poller, not a thread.
        self.pending_conns.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_pending_socket_readable, conn))

    def _handshake_wait(self, conn: VerifiedConn, events: int) -> None:
        callback = partial(self._handshake_step, conn)
        if conn in self.handshaking:
            if self.handshaking[conn] != events:
                self.poller.modify(conn.sock, events, callback)
        else:
            self.poller.register(conn.sock, events, callback)
        self.handshaking[conn] = events

    def _handshake_drop(self, conn: VerifiedConn) -> None:
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
        self.intake.expire(now)


def _peer(conn: TConn) -> str:
    try:
        host, port = conn.client[:2]
        return f"{host}:{port}"
    except (TypeError, ValueError):
        return str(conn.client)


def _listener_alive_loop() -> None:
    """Tell the lost-node sweep that the agent API is up and can hear nodes."""
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
        release_database_connection()
        time.sleep(ALIVE_EVERY)
