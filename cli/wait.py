"""Waiting for an outcome, bounded in time: ``llmgw demo`` waits for its
nodes this way, and so do the tests and benchmarks that drive real processes."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float, *, interval: float = 0.1, message: str = "condition"):
    """Poll ``predicate`` until it returns something truthy, and return that.

    It is asked at least once, and once more at the deadline; after that a
    ``TimeoutError`` names what was awaited.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)
