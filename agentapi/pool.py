"""The threads that answer the agent API's requests (gthread's
``get_thread_pool`` hook, which expects an executor).

A ``concurrent.futures`` executor whose idle threads form a stack: the
thread that went idle last takes the next request. At a few requests in
flight, the same few threads then do all the work with their state still in
the CPU's caches while the rest wait for a burst; ``ThreadPoolExecutor``'s
shared queue wakes them in turn, which cost about a quarter more CPU per
request over sixteen threads (bench/heartbeats.py).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Executor, Future


class _Slot:
    __slots__ = ("wake", "job")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()  # released by submit() when it hands this thread a job
        self.job = None


_STOP = object()


class StackPool(Executor):
    def __init__(self, threads: int, *, name: str = "agent-api") -> None:
        self._lock = threading.Lock()
        self._backlog: deque = deque()
        self._idle: list[_Slot] = []
        self._slots = [_Slot() for _ in range(threads)]
        for i, slot in enumerate(self._slots):
            threading.Thread(target=self._serve, args=(slot,), name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        job = (future, fn, args, kwargs)
        with self._lock:
            if not self._idle:
                self._backlog.append(job)
                return future
            slot = self._idle.pop()
        slot.job = job
        slot.wake.release()
        return future

    def _next(self, slot: _Slot):
        with self._lock:
            if self._backlog:
                return self._backlog.popleft()
            self._idle.append(slot)
        slot.wake.acquire()
        job, slot.job = slot.job, None
        return job

    def _serve(self, slot: _Slot) -> None:
        while True:
            job = self._next(slot)
            if job is _STOP:
                return
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the future, as ThreadPoolExecutor does
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Threads finish what they hold and stop (gthread asks for ``wait=False``)."""
        with self._lock:
            self._backlog.extend(_STOP for _ in self._slots)
            idle, self._idle = self._idle, []
            handed = [(slot, self._backlog.popleft()) for slot in idle]
        for slot, job in handed:
            slot.job = job
            slot.wake.release()
