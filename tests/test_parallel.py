"""Each pytest-xdist worker's own services (tests/parallel.py): no two
workers share a Redis database, an engine port or a data directory."""

from __future__ import annotations

import pytest

from tests.parallel import port_slice, redis_url_for, worker_environment


def test_workers_count_redis_databases_down_from_the_given_one():
    assert [redis_url_for("redis://127.0.0.1:6379/15", n) for n in range(4)] == [
        "redis://127.0.0.1:6379/15", "redis://127.0.0.1:6379/14",
        "redis://127.0.0.1:6379/13", "redis://127.0.0.1:6379/12"]
    assert redis_url_for("redis://127.0.0.1:6379", 0) == "redis://127.0.0.1:6379"
    assert redis_url_for("redis://h:1/5?timeout=3", 1) == "redis://h:1/4?timeout=3"
    assert redis_url_for("filesystem://", 3) == "filesystem://"  # no Redis: nothing to share


def test_too_many_workers_for_the_databases_below_is_an_error_naming_it():
    with pytest.raises(RuntimeError, match="below 0"):
        redis_url_for("redis://127.0.0.1:6379/2", 3)


def test_engine_port_slices_cover_the_range_without_overlap():
    slices = [port_slice(20000, 29999, n, 4) for n in range(4)]
    assert slices == [(20000, 22499), (22500, 24999), (25000, 27499), (27500, 29999)]
    with pytest.raises(RuntimeError, match="too small"):
        port_slice(25000, 25099, 0, 2)


def test_a_worker_overrides_broker_liveness_ports_and_data_directory():
    environ = {"CELERY_BROKER_URL": "redis://127.0.0.1:6379/15", "LLMGW_REDIS_URL": "redis://127.0.0.1:6379/15",
               "LLMGW_DATA_DIR": "/srv/var/test"}
    assert worker_environment(environ, 2, 4) == {
        "CELERY_BROKER_URL": "redis://127.0.0.1:6379/13", "LLMGW_REDIS_URL": "redis://127.0.0.1:6379/13",
        "LLMGW_PORT_MIN": "25000", "LLMGW_PORT_MAX": "27499", "LLMGW_DATA_DIR": "/srv/var/test/gw2"}


def test_e2e_modules_go_whole_to_one_of_two_groups_and_other_tests_alone():
    from tests.parallel import CLUSTER_GROUPS, work_unit

    assert work_unit("tests/nodes/test_api.py::test_x[1]") == "tests/nodes/test_api.py::test_x[1]"
    assert work_unit("tests/e2e/test_failures.py::test_a") == work_unit("tests/e2e/test_failures.py::test_b")
    assert work_unit("tests/e2e/test_process_faults.py::t") != work_unit("tests/e2e/test_failures.py::t")
    assert work_unit("tests/e2e/test_new_module.py::t") in CLUSTER_GROUPS
