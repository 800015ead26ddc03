"""Each pytest-xdist worker gets services of its own; loaded with ``-p`` (pyproject's addopts).

``make test`` runs the suite in several worker processes (``-n``). They share
PostgreSQL, Redis and the machine's ports, and every test flushes its Redis
database and starts control planes whose engines take ports from
``LLMGW_PORT_MIN``..``LLMGW_PORT_MAX`` on the simulated nodes' fixed
addresses. So worker ``gwN`` of ``n``:

- uses Redis database ``D - N``, where ``D`` is the database of
  ``LLMGW_REDIS_URL`` (``CELERY_BROKER_URL`` likewise): 15, 14, ... for ``make test``;
- takes the N-th of ``n`` equal slices of the engine port range;
- keeps its files under ``$LLMGW_DATA_DIR/gwN``;
- and pytest-django already gives it the database ``test_<name>_gwN``.

This must happen before Django reads its settings (pytest-django does that
before any conftest is imported), and in ``os.environ``, so that every process
a test starts inherits it: hence a plugin module imported by ``-p``. xdist
sets ``PYTEST_XDIST_WORKER`` before the worker parses its configuration.
Outside a worker nothing changes.

It also marks the environment with ``LLMGW_TEST_SESSION`` (this process's
pid), which every process a test starts inherits; tests/conftest.py finds the
ones left running at the end of the session by it.
"""

from __future__ import annotations

import os
import re
import zlib
from urllib.parse import urlsplit, urlunsplit

import pytest

SESSION_MARK = "LLMGW_TEST_SESSION"


def worker_index() -> tuple[int, int] | None:
    """(index, count) in an xdist worker, None otherwise."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    match = re.fullmatch(r"gw(\d+)", worker)
    if not match:
        return None
    return int(match[1]), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def redis_url_for(url: str, index: int) -> str:
    """The worker's database on the same Redis; a URL that is not Redis stays as it is."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or index == 0:
        return url
    db = int(parts.path.strip("/") or 0)
    if db - index < 0:
        raise RuntimeError(f"{url}: Redis database {db} minus worker {index} is below 0; "
                           "start from a higher database or run fewer workers")
    return urlunsplit(parts._replace(path=f"/{db - index}"))


def port_slice(low: int, high: int, index: int, count: int) -> tuple[int, int]:
    size = (high - low + 1) // count
    if size < 100:
        raise RuntimeError(f"engine port range {low}-{high} is too small for {count} workers")
    return low + index * size, low + (index + 1) * size - 1


def worker_environment(environ: dict[str, str], index: int, count: int) -> dict[str, str]:
    """The variables worker ``index`` of ``count`` overrides."""
    changed = {}
    for name in ("CELERY_BROKER_URL", "LLMGW_REDIS_URL"):
        if environ.get(name):
            changed[name] = redis_url_for(environ[name], index)
    # settings.py's defaults; a range set by hand is sliced the same way.
    low, high = int(environ.get("LLMGW_PORT_MIN", 20000)), int(environ.get("LLMGW_PORT_MAX", 29999))
    low, high = port_slice(low, high, index, count)
    changed.update(LLMGW_PORT_MIN=str(low), LLMGW_PORT_MAX=str(high))
    if environ.get("LLMGW_DATA_DIR"):
        changed["LLMGW_DATA_DIR"] = os.path.join(environ["LLMGW_DATA_DIR"], f"gw{index}")
    return changed


def _configure_worker() -> None:
    os.environ[SESSION_MARK] = str(os.getpid())
    position = worker_index()
    if position is not None:
        os.environ.update(worker_environment(dict(os.environ), *position))


_configure_worker()


# --- end-to-end modules in two groups -----------------------------------------------------------
# Each group runs on one worker, one test at a time: at most two simulated
# clusters at once, so that their shortened clocks (a 3 s grace) keep their
# meaning on two cores. Seconds each module took in one process on two shared
# cores (--durations), split about evenly; a module not listed joins the group
# its name hashes to. (xdist's own --dist loadgroup marks a test by changing
# its nodeid, which pytest 9 no longer lets it do: the scheduler is ours.)
CLUSTER_GROUPS = ("clusters-a", "clusters-b")
E2E_MODULE_GROUP = {
    "test_process_faults.py": 0,  # 198 s
    "test_dependency_outages.py": 0,  # 103 s
    "test_demo.py": 0,  # 83 s
    "test_production_set.py": 0,  # 40 s
    "test_rotation_engines.py": 0,  # 34 s
    "test_control_plane_outage.py": 1,  # 143 s
    "test_failures.py": 1,  # 89 s
    "test_drain_traffic.py": 1,  # 78 s
    "test_ui.py": 1,  # 40 s
    "test_defrag.py": 1,  # 35 s
    "test_seeds_scenario.py": 1,  # 24 s
}


def work_unit(nodeid: str) -> str:
    """What the scheduler hands a worker whole: an e2e module's group, or the test alone."""
    path = nodeid.split("::", 1)[0]
    if not path.startswith("tests/e2e/"):
        return nodeid
    module = path.rsplit("/", 1)[1]
    return CLUSTER_GROUPS[E2E_MODULE_GROUP.get(module, zlib.crc32(module.encode()) % len(CLUSTER_GROUPS))]


@pytest.hookimpl(optionalhook=True)  # a run without pytest-xdist installed does not know the hook
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ClusterGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ClusterGroupScheduling(config, log)
