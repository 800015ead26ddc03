"""The Celery app with pause points, for killing a worker at a known moment.

Started as ``celery -A tests.e2e.paused_worker worker`` with
``LLMGW_TEST_PAUSE_DIR`` set. When the file ``<dir>/<point>`` exists, the
first task to reach that point removes it (one pauser among all workers),
writes its process id to ``<dir>/<point>.paused`` and sleeps there, inside
its transaction and holding its row locks, until the test kills the process.

Pause points, each inside the transaction of the step it names:
- ``reconcile``: a placement has been written (members, GPUs, ports, the
  nodes' desired versions), not yet committed;
- ``drain``: a drain step has moved its replicas, not yet saved the drain;
- ``rebuild``: a replica of a lost node has been failed (the node's LOST
  transition is committed), the failure not yet committed.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from llmgw_site.celery import app  # noqa: F401 - the app celery -A loads

PAUSE_DIR = os.environ.get("LLMGW_TEST_PAUSE_DIR", "")


def _pause_if_armed(point: str) -> None:
    armed = Path(PAUSE_DIR) / point
    try:
        armed.unlink()
    except FileNotFoundError:
        return
    armed.with_name(f"{point}.paused").write_text(str(os.getpid()))
    while True:
        time.sleep(60)


def _paused_after(point: str, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        _pause_if_armed(point)
        return result

    return wrapper


@app.on_after_finalize.connect
def _install(sender, **_kwargs):
    if not PAUSE_DIR:
        return
    import django

    django.setup()
    from replicas import drain, scheduling, services

    scheduling.nodes_desired_changed = _paused_after("reconcile", scheduling.nodes_desired_changed)
    drain._drain_settle = _paused_after("drain", drain._drain_settle)
    services.replica_fail = _paused_after("rebuild", services.replica_fail)
