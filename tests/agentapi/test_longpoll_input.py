"""The desired-state long-poll's parameters: a wait that is not a finite
number of seconds (``nan`` was parked for good) is a 400 naming ``wait``."""

from __future__ import annotations

import time

import pytest

from nodes.models import Node
from nodes.longpoll import MAX_WAIT, LongPollInvalid, longpoll_params
from tests.conftest import mtls_client
from tests.nodes.test_agent_api import heartbeat_url, payload

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("version", "wait", "expected"),
    [(None, None, (None, 0.0)), ("3", "30", (3, 30.0)), ("0", "0", (0, 0.0)), ("3", "1e300", (3, MAX_WAIT)),
     ("3", "61", (3, MAX_WAIT)), ("3", "0.5", (3, 0.5))],
)
def test_valid_parameters_and_a_long_wait_cut_to_the_most(version, wait, expected):
    assert longpoll_params(version=version, wait=wait) == expected


@pytest.mark.parametrize(
    ("version", "wait", "field"),
    [("3", "nan", "wait"), ("3", "NaN", "wait"), ("3", "inf", "wait"), ("3", "-inf", "wait"), ("3", "-1", "wait"),
     ("3", "1e309", "wait"), ("3", "soon", "wait"), ("3", "", "wait"), ("x", "5", "version"), ("-1", "5", "version"),
     ("1.5", "5", "version")],
)
def test_invalid_parameters_name_the_field(version, wait, field):
    with pytest.raises(LongPollInvalid) as caught:
        longpoll_params(version=version, wait=wait)
    assert caught.value.field == field and field in str(caught.value)


def test_a_wait_that_is_not_a_finite_number_is_answered_400_at_once(agent_api, client_cert):
    creds = client_cert("node01")
    with mtls_client(*creds, timeout=10) as client:
        assert client.post(heartbeat_url(agent_api, "node01"), json=payload()).status_code == 200
        version = Node.objects.get(name="node01").desired_version
        url = f"{agent_api.url}/agent/v1/nodes/node01/desired"
        for wait in ("nan", "inf", "-1", "1e309", "-0.5"):
            started = time.monotonic()
            r = client.get(url, params={"version": version, "wait": wait})
            assert r.status_code == 400, (wait, r.status_code, r.text)
            assert "wait" in r.json()["details"] and wait in r.json()["error"]
            assert time.monotonic() - started < 5, wait
        r = client.get(url, params={"version": "latest", "wait": "5"})
        assert r.status_code == 400 and "version" in r.json()["details"], r.text
        # A valid long-poll with a stale version is answered at once, and one
        # that is current waits its (short) time, then answers.
        assert client.get(url, params={"version": version + 1, "wait": "30"}).status_code == 200
        started = time.monotonic()
        r = client.get(url, params={"version": version, "wait": "1"})
        assert r.status_code == 200 and 0.8 < time.monotonic() - started < 5, r.text
