"""Parking desired-state long-polls in the worker's event loop.

A long-poll held in a pool thread costs one thread per node for as long as it
waits; a thousand agents would need a thousand threads, and a burst of them
would starve heartbeats. Here a long-poll that has nothing to say yet is
parked: its socket sits in the selector, no thread holds it, and the request
is re-run through Django when the node's state changes or its wait runs out
(``nodes.longpoll`` decides what may be parked and publishes the changes).
"""

from __future__ import annotations

import logging
import selectors
import threading
import time
from collections import defaultdict
from functools import partial

from django.db import close_old_connections

from nodes import liveness, longpoll

from .background import release_database_connection
from .worker import AgentApiWorker

logger = logging.getLogger(__name__)

DB_POLL_EVERY = 0.25


class AgentApiParkingWorker(AgentApiWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.parked: dict[str, list] = defaultdict(list)
        self.changed_at: dict[str, float] = {}
        self._parked_lock = threading.Lock()

    def run(self) -> None:
        target = self._pubsub_loop if longpoll.use_pubsub() else self._db_poll_loop
        threading.Thread(target=target, name="desired-watch", daemon=True).start()
        super().run()

    # --- in a pool thread -----------------------------------------------------

    def handle(self, conn):
        resume = getattr(conn, "resume_req", None)
        if resume is None:
            return super().handle(conn)
        conn.resume_req = None
        try:
            conn.sock.setblocking(True)
            return self._keepalive_after(conn, super().handle_request(resume, conn))
        except Exception as exc:  # noqa: BLE001 - same policy as gthread: drop the connection
            self.log.debug("resumed long-poll failed: %s", exc)
            return False

    def handle_request(self, req, conn):
        checked_at = time.monotonic()
        peer = None
        try:
            peer = conn.sock.getpeercert(binary_form=True)
        except (OSError, ValueError):
            pass
        try:
            park = longpoll.parkable(method=req.method, path=req.path, query=req.query, peer_der=peer)
        except Exception:  # noqa: BLE001 - let the view answer, and report, whatever went wrong
            logger.exception("long-poll check failed; answering at once")
            park = None
        if park is None:
            return super().handle_request(req, conn)
        conn.park = (park, req, checked_at)
        return True

    # --- in the main loop -------------------------------------------------------

    def finish_request(self, conn, fs):
        park = getattr(conn, "park", None)
        if park is not None and not fs.cancelled() and fs.exception() is None and fs.result():
            conn.park = None
            self._park(conn, *park)
            return
        conn.park = None
        super().finish_request(conn, fs)

    def _park(self, conn, park, req, checked_at) -> None:
        conn.parked = (park.node, req, park.version)
        conn.timeout = time.monotonic() + park.wait
        conn.sock.setblocking(False)
        with self._parked_lock:
            self.parked[park.node].append(conn)
        # The client closing (or sending anything) while parked ends the wait.
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._parked_readable, conn))
        if self.changed_at.get(park.node, 0.0) >= checked_at:
            self._wake(park.node)

    def _unpark(self, conn) -> None:
        node = conn.parked[0]
        with self._parked_lock:
            waiting = self.parked.get(node, [])
            if conn in waiting:
                waiting.remove(conn)
            if not waiting:
                self.parked.pop(node, None)
        try:
            self.poller.unregister(conn.sock)
        except (OSError, KeyError, ValueError):
            pass

    def _resume(self, conn) -> None:
        self._unpark(conn)
        req = conn.parked[1]
        conn.parked = None
        conn.resume_req = req
        conn.data_ready = True
        # The request was read whole before it was parked: straight to a thread.
        self.tpool.put(conn)

    def _parked_readable(self, conn, _fileobj) -> None:
        self._unpark(conn)
        conn.parked = None
        self.nr_conns -= 1
        conn.close()

    def _wake(self, node: str) -> None:
        with self._parked_lock:
            waiting = list(self.parked.get(node, []))
        for conn in waiting:
            self._resume(conn)

    def murder_pending(self) -> None:
        super().murder_pending()
        now = time.monotonic()
        with self._parked_lock:
            expired = [c for conns in self.parked.values() for c in conns if c.timeout <= now]
        for conn in expired:
            self._resume(conn)

    # --- watching for changes (a background thread) --------------------------

    def _changed(self, node: str) -> None:
        self.changed_at[node] = time.monotonic()
        self.method_queue.defer(self._wake, node)

    def _pubsub_loop(self) -> None:
        while True:
            try:
                client = liveness.store().client
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(liveness.channel_scoped(client, longpoll.CHANNEL))
                for message in pubsub.listen():
                    if message.get("type") == "message":
                        for node in liveness.channel_nodes(message["data"]):
                            self._changed(node)
            except Exception as exc:  # noqa: BLE001 - Redis went away: retry, parked polls time out meanwhile
                logger.warning("desired-state watch lost Redis: %s; retrying", exc)
                time.sleep(1.0)

    def _db_poll_loop(self) -> None:
        while True:
            time.sleep(DB_POLL_EVERY)
            with self._parked_lock:
                waiting = {node: {c.parked[2] for c in conns if c.parked} for node, conns in self.parked.items()}
            if not waiting:
                continue
            try:
                current = longpoll.versions(list(waiting))
            except Exception as exc:  # noqa: BLE001
                logger.warning("desired-state watch cannot read the database: %s", exc)
                close_old_connections()
                continue
            finally:
                release_database_connection()
            for node, version in current.items():
                if waiting[node] - {version}:
                    self._changed(node)
