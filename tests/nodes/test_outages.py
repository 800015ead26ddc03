"""A dependency away: 503 naming it, the agent's reading of a 503, the told
backoff cap, and timings that cannot work together refused at start.
(The faults themselves, on real processes: tests/e2e/test_dependency_outages.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from agent.client import ControlPlaneClient, ServerError, Unavailable
from agent.config import AgentConfig, SupervisorConfig, TlsConfig
from agent.runner import ReconnectCap
from accounts.services import token_create
from core import outages
from core.models import Event
from nodes import liveness
from tests.conftest import REPO, free_port
from tests.factories import NodeFactory


@pytest.fixture
def redis_away(settings):
    """Liveness pointed at a port nothing listens on."""
    settings.LLMGW_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    liveness.store.cache_clear()
    yield
    liveness.store.cache_clear()
    outages.redis_dependency.down_since = None


@pytest.mark.django_db
def test_operator_api_answers_503_naming_redis_when_it_is_away(redis_away):
    NodeFactory(name="node01")
    user = get_user_model().objects.create_superuser("operator", "", "operator-password-for-tests")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_create(user=user).token}")
    response = client.get("/api/v1/nodes/")
    assert response.status_code == 503
    assert response["Retry-After"] == str(outages.RETRY_AFTER)
    assert response.json()["dependency"] == "redis"
    assert "Redis" in response.json()["detail"] and "unreachable" in response.json()["detail"]


def test_only_outages_are_unavailable():
    from django.db import IntegrityError, OperationalError

    assert outages.unavailable(OperationalError("connection refused")) == outages.DATABASE
    assert outages.unavailable(IntegrityError("duplicate key")) is None
    assert outages.unavailable(ValueError("a bug")) is None


@pytest.mark.django_db(transaction=True)
def test_an_outage_is_recorded_once_for_every_process_that_saw_it():
    seen_by = [outages.Dependency(outages.REDIS, "") for _ in range(2)]
    for dependency in seen_by:
        dependency.failed(ConnectionError("refused"))
    for dependency in seen_by:
        dependency.recovered()
    (event,) = Event.objects.filter(subject="dependency/redis")
    assert "was unreachable for" in event.message and event.data["dependency"] == "redis"


def test_a_503_is_read_as_unavailable_with_its_retry_after():
    response = httpx.Response(503, headers={"Retry-After": "2"},
                              json={"error": "the database is unreachable", "dependency": "database"})
    with pytest.raises(Unavailable) as raised:
        ControlPlaneClient._raise_for_status(response)
    assert raised.value.retry_after == 2.0 and raised.value.dependency == "database"
    assert isinstance(raised.value, ServerError)  # older callers treat it as any 5xx


def test_the_told_reconnect_cap_is_kept_across_restarts(tmp_path):
    config = AgentConfig(node_id="node01", server="https://127.0.0.1:7443",
                         tls=TlsConfig(ca=tmp_path, cert=tmp_path, key=tmp_path), mgmt_addr="127.0.1.1",
                         supervisor=SupervisorConfig(work_dir=tmp_path))
    cap = ReconnectCap(config)
    assert cap.value == 30.0
    cap.tell(2.0)
    assert cap.value == 2.0
    assert ReconnectCap(config).value == 2.0, "a restarted agent backs off no longer than it was told"
    cap.tell(60.0)
    assert cap.value == 30.0, "never longer than its own configuration"


@pytest.mark.parametrize("env, says", [
    ({"LLMGW_NODE_GRACE": "3"}, "shorter than two heartbeat intervals"),
    ({"LLMGW_NODE_GRACE": "10", "LLMGW_AGENT_RECONNECT_MAX": "20"}, "LLMGW_AGENT_RECONNECT_MAX=20"),
    ({"LLMGW_DEAF_AFTER": "1"}, "LLMGW_DEAF_AFTER=1 is shorter than two sweeps"),
])
def test_timings_that_cannot_work_together_are_refused_at_start(tmp_path, env, says):
    done = subprocess.run([sys.executable, "-m", "cli", "up", "--data-dir", str(tmp_path)], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.startswith("llmgw: settings that cannot work together"), done.stderr[-500:]
    assert says in done.stderr
    assert "Traceback" not in done.stderr


def test_the_heartbeat_reply_tells_a_cap_that_fits_the_grace(settings):
    from nodes.clock import agent_reconnect_max, post_outage_grace

    settings.LLMGW_NODE_GRACE, settings.LLMGW_HEARTBEAT_INTERVAL, settings.LLMGW_AGENT_RECONNECT_MAX = 3.0, 1.0, 0.0
    assert agent_reconnect_max() == 2.0 and post_outage_grace() == 3.0
    settings.LLMGW_NODE_GRACE, settings.LLMGW_HEARTBEAT_INTERVAL = 60.0, 5.0
    assert agent_reconnect_max() == 30.0
