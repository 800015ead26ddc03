"""End-to-end tests: whole control planes as real processes.

Under pytest-xdist (``make test`` runs ``-n``) these modules form two groups,
each run by one worker, one test at a time (tests/parallel.py, work_unit).
"""

from tests.control_plane import celery_factory, heartbeaters  # noqa: F401 - fixtures for every e2e test
from tests.e2e.sim import sim_cluster  # noqa: F401 - the simulated cluster, for every e2e test
