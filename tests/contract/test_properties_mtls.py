"""A short run of the heartbeat property over the real listener: gunicorn,
mTLS, the agent API's own middleware and body handling, another process
writing the database (the in-process run in test_properties.py is the long one)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.conftest import mtls_client
from tests.contract.conftest import heartbeat_template
from tests.contract.snapshots import db_state
from tests.contract.strategies import mutated

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def wire(agent_api, client_cert):
    with mtls_client(*client_cert("node01"), timeout=20) as client:
        url = f"{agent_api.url}/agent/v1/nodes/node01/heartbeat"
        base = {**heartbeat_template(), "engines": []}
        assert client.post(url, json=base).status_code == 200
        yield client, url, base


@settings(max_examples=30, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=mutated(heartbeat_template()))
def test_over_mtls_any_heartbeat_is_accepted_or_refused_and_a_refusal_writes_nothing(wire, data):
    client, url, _ = wire
    # The listener records liveness behind the answer (nodes.liveness.HeartbeatFeed):
    # an earlier accepted heartbeat's mark may land during this one. The rows are compared.
    before = rows()
    try:
        content = json.dumps(data).encode()
    except (ValueError, RecursionError):
        return
    response = client.post(url, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text[:500]
    if response.status_code != 200:
        assert response.json()["error"]
        assert rows() == before


def rows() -> dict:
    return {k: v for k, v in db_state().items() if k != "seen"}
