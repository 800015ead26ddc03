"""Reading requests in the worker's event loop, whole, before a thread sees them.

A pool thread that reads a request from the socket is held for as long as the
client takes to send it: one byte every few seconds holds it for good, and a
few dozen such connections (with any certificate the authority signed) starve
every node's heartbeats. Here the event loop reads what a connection has,
non-blocking, into a buffer, until the request is whole (``framing.py``), and
then answers it itself if it is a heartbeat that brings no news or a ping
(``quick.py``), or else hands the connection to a thread, with the bytes already in its
parser's buffer; the parser reads from that buffer alone and never from the
socket (``VerifiedConn.init``).

Deadlines, enforced from ``murder_pending``:

- a request must arrive whole within ``LLMGW_AGENT_REQUEST_TIMEOUT`` of its
  first byte, or its connection is closed (after a best-effort 408);
- a connection with nothing started is idle: gunicorn closes it after the
  keep-alive timeout (``LLMGW_AGENT_IDLE_TIMEOUT``), as before;
- a connection closed "gracefully" (its response said ``Connection: close``)
  waits for the client's end in the event loop for ``LINGER`` seconds at most,
  instead of gunicorn's blocking drain of up to two seconds in the event loop.
"""

from __future__ import annotations

import logging
import selectors
import socket
import ssl
import time
from functools import partial
from typing import TYPE_CHECKING

from gunicorn import util

from .framing import MAX_HEAD, Framing, Refusal

if TYPE_CHECKING:
    from .worker import AgentApiWorker, VerifiedConn

logger = logging.getLogger(__name__)

LINGER = 2.0
_RECV = 64 * 1024
_LINGER_DRAIN = 64 * 1024


class Intake:
    def __init__(self, worker: AgentApiWorker, *, request_timeout: float, max_body: int) -> None:
        self.worker = worker
        self.request_timeout = request_timeout
        self.max_body = max_body
        # Bytes read for one request before giving up on it (chunk framing adds some).
        self.max_request = MAX_HEAD + 2 * max_body
        # Connections the event loop is reading a request from, and those
        # waiting for the client's end after a graceful close: conn -> deadline.
        self.reading: dict[VerifiedConn, float] = {}
        self.lingering: dict[VerifiedConn, float] = {}

    # --- reading ----------------------------------------------------------------

    def read(self, conn: VerifiedConn, _fileobj=None) -> None:
        """Read what ``conn`` has; hand it to a thread once a request is whole."""
        buf = conn.inbuf
        started = bool(buf)  # this request's deadline is already running
        if conn.parser is not None:
            # Bytes the last request's parse left over: the next request's start.
            buf += conn.parser.unreader.take_buffered()
        eof = False
        try:
            conn.sock.setblocking(False)
            while len(buf) <= self.max_request:
                data = conn.sock.recv(_RECV)
                if not data:
                    eof = True
                    break
                buf += data
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            pass
        except ssl.SSLZeroReturnError:
            eof = True
        except OSError as exc:
            logger.debug("agent-api read from %s failed: %s", conn.name(), exc)
            self._close(conn)
            return
        if buf and not started:
            conn.request_deadline = time.monotonic() + self.request_timeout
        if conn.framing is None:
            conn.framing = Framing(max_body=self.max_body)
        try:
            end = conn.framing.end(buf) if buf else None
            if end is None and len(buf) > self.max_request:
                raise Refusal(413, "Content Too Large", f"the request is over {self.max_request} bytes")
        except Refusal as refusal:
            logger.info("agent-api refused a request from %s: %s %s", conn.name(), refusal.status, refusal.message)
            self._refuse(conn, refusal)
            return
        if end is None:
            if eof:
                self._close(conn)
                return
            deadline = conn.request_deadline if buf else time.monotonic() + conn.keepalive
            self._wait(conn, deadline)
            return
        self._stop_waiting(conn)
        if end == len(buf) and self.worker.answer_quickly(conn, bytes(buf)):
            buf.clear()
            conn.framing.reset()
            return
        conn.buffered_parser().unreader.unread(bytes(buf))
        buf.clear()
        conn.framing.reset()
        conn.data_ready = True
        self.worker.tpool.put(conn)

    def _wait(self, conn: VerifiedConn, deadline: float) -> None:
        if conn not in self.reading:
            self.worker.poller.register(conn.sock, selectors.EVENT_READ, partial(self.read, conn))
        self.reading[conn] = deadline

    def _stop_waiting(self, conn: VerifiedConn) -> None:
        if self.reading.pop(conn, None) is not None:
            _unregister(self.worker.poller, conn.sock)

    def _close(self, conn: VerifiedConn) -> None:
        self._stop_waiting(conn)
        self.worker.nr_conns -= 1
        conn.close()

    def _refuse(self, conn: VerifiedConn, refusal: Refusal) -> None:
        self._stop_waiting(conn)
        _send_now(conn.sock, refusal.response())
        self.worker.nr_conns -= 1
        conn.close(graceful=True)

    # --- closing ----------------------------------------------------------------

    def linger(self, conn: VerifiedConn) -> None:
        """Close after the response: send our end now, and let the client's end
        (or ``LINGER`` seconds) close the socket, so that bytes it still sends
        do not reset the connection before it has read the answer."""
        sock = conn.sock
        try:
            sock.setblocking(False)
            sock.shutdown(socket.SHUT_WR)
            self.worker.poller.register(sock, selectors.EVENT_READ, partial(self._linger_readable, conn))
        except (OSError, ValueError, KeyError):
            util.close(sock)
            return
        conn.drained = 0
        self.lingering[conn] = time.monotonic() + LINGER

    def _linger_readable(self, conn: VerifiedConn, _fileobj=None) -> None:
        try:
            data = conn.sock.recv(_RECV)
        except (BlockingIOError, ssl.SSLWantReadError):
            return
        except OSError:
            data = b""
        conn.drained += len(data)
        if not data or conn.drained > _LINGER_DRAIN:
            self._end_linger(conn)

    def _end_linger(self, conn: VerifiedConn) -> None:
        if self.lingering.pop(conn, None) is not None:
            _unregister(self.worker.poller, conn.sock)
        util.close(conn.sock)

    def expire(self, now: float) -> None:
        for conn in [c for c, deadline in self.reading.items() if deadline <= now]:
            if conn.inbuf:
                logger.info(
                    "agent-api request from %s not whole after %.0fs (LLMGW_AGENT_REQUEST_TIMEOUT): closed",
                    conn.name(), self.request_timeout,
                )
                self._refuse(conn, Refusal(408, "Request Timeout", "the request did not arrive in time"))
            else:
                self._close(conn)
        for conn in [c for c, deadline in self.lingering.items() if deadline <= now]:
            self._end_linger(conn)


def _send_now(sock, data: bytes) -> None:
    """One non-blocking send of a short answer; a client not reading loses it."""
    try:
        sock.setblocking(False)
        sock.send(data)
    except (OSError, ValueError):
        pass


def _unregister(poller, sock) -> None:
    try:
        poller.unregister(sock)
    except (OSError, KeyError, ValueError):
        pass
