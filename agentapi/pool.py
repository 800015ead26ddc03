"""The threads that answer the agent API's requests.

What gthread's ThreadPoolExecutor did, without the Future, Condition and
callbacks it built for every request: connections go to a thread over a lock
per thread. A connection kept alive goes back to the poller from the thread
that answered (``AgentApiWorker.keep_alive_here``); only the others (closed,
parked, failed) come back to the main loop, through the worker's method
queue, with their result in a completed ``Future`` as gthread's
``finish_request`` expects.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .worker import AgentApiWorker


class _PoolSlot:
    __slots__ = ("wake", "conn")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()  # released by put() when it hands this thread a connection
        self.conn = None


_STOP = object()


class ConnectionPool:
    """Threads taking connections from the main loop and handing them back.

    The thread that went idle last takes the next connection (a stack, not a
    queue): at a few requests in flight, the same few threads do all the
    work with their state still in the CPU's caches, while the rest wait for
    a burst. Round-robin over sixteen threads cost a quarter more CPU per
    request (bench/heartbeats.py).
    """

    def __init__(self, worker: AgentApiWorker, threads: int) -> None:
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

    def _next(self, slot: _PoolSlot):
        with self._lock:
            if self._backlog:
                return self._backlog.popleft()
            self._idle.append(slot)
        slot.wake.acquire()
        conn, slot.conn = slot.conn, None
        return conn

    def _serve(self, slot: _PoolSlot) -> None:
        worker = self._worker
        while True:
            conn = self._next(slot)
            if conn is _STOP:
                return
            try:
                result = worker.handle(conn)
            except BaseException as exc:  # noqa: BLE001 - finish_request closes the connection
                done = Future()
                done.set_exception(exc)
            else:
                if result is True and worker.keep_alive_here(conn):
                    continue
                done = Future()  # only here, off the kept-alive path: it costs a Condition
                done.set_result(result)
            worker.method_queue.defer(worker.finish_request, conn, done)

    def shutdown(self, wait: bool = False) -> None:
        """As ``ThreadPoolExecutor.shutdown``, which gthread calls: threads
        finish what they hold and stop; ``wait`` is not honoured (gthread
        never asks for it)."""
        with self._lock:
            self._backlog.extend(_STOP for _ in self._slots)
            idle, self._idle = self._idle, []
        for slot in idle:
            slot.conn = self._backlog.popleft()
            slot.wake.release()
