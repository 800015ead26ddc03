"""End-to-end tests: whole control planes as real processes.

Under pytest-xdist (``make test`` runs ``-n``, with ``--dist loadgroup``),
the modules here form two groups, each run by one worker, one test at a time:
at most two simulated clusters run at once, beside the other workers' lighter
tests, so that a cluster's shortened clocks (a 3 s grace) keep their meaning
on a two-core machine. The split is by measured time (docs/development.md);
a module not listed joins the group its name hashes to.
"""

import zlib
from pathlib import Path

import pytest

from tests.control_plane import celery_factory, heartbeaters  # noqa: F401 - fixtures for every e2e test
from tests.e2e.sim import sim_cluster  # noqa: F401 - the simulated cluster, for every e2e test

HERE = Path(__file__).resolve().parent
GROUPS = ("clusters-a", "clusters-b")
# Seconds each module took in one process on two shared cores (--durations), split about evenly.
MODULE_GROUP = {
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


def cluster_group(module: str) -> str:
    index = MODULE_GROUP.get(module, zlib.crc32(module.encode()) % len(GROUPS))
    return GROUPS[index]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # A conftest's hook sees every collected item, not only this directory's.
    for item in items:
        path = Path(str(item.path))
        if path.parent == HERE:
            item.add_marker(pytest.mark.xdist_group(cluster_group(path.name)))
