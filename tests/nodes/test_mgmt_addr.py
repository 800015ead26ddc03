"""A node's certificate cannot aim the gateway anywhere: its mgmt_addr is an
address, checked where it enters (heartbeat, onboarding, agent.yaml), and
every URL to an engine is built from parts (issue 19, item 2)."""

from __future__ import annotations

import pytest

from nodes.models import Node

from .test_agent_api import payload, post, snapshot

pytestmark = pytest.mark.django_db(transaction=True)

# The probe's value: with the old `http://{mgmt_addr}:{port}` it made a chat
# completion return an internal service's answer.
PROBE = "::ffff:127.0.1.202]:18099/internal/admin?x="


NOT_ADDRESSES = [
    PROBE, "127.0.1.5:8080", "127.0.1.5/x", "[::1]", "::ffff:127.0.1.202", "fe80::1", "fe80::1%eth0",
    "0.0.0.0", "::", "224.0.0.1", "node01.example", "http://10.0.0.1",
]


def test_a_heartbeat_whose_mgmt_addr_is_not_an_address_is_refused_and_nothing_stored(agent_api, client_cert):
    creds = client_cert("addr-node")
    before = snapshot()
    for addr in NOT_ADDRESSES:
        r = post(agent_api, creds, "addr-node", payload(mgmt_addr=addr))
        assert r.status_code == 400, (addr, r.text)
        assert "mgmt_addr" in r.json()["details"], r.text
        assert snapshot() == before


def test_loopback_nodes_only_where_the_deployment_allows_them(agent_api_factory, client_cert):
    creds = client_cert("loop-node")
    strict = agent_api_factory(LLMGW_ALLOW_LOOPBACK_NODES="0")
    r = post(strict, creds, "loop-node", payload(mgmt_addr="127.0.1.5"))
    assert r.status_code == 400 and "LLMGW_ALLOW_LOOPBACK_NODES" in r.text, r.text
    assert not Node.objects.filter(name="loop-node").exists()
    assert post(strict, creds, "loop-node", payload(mgmt_addr="10.20.0.5")).status_code == 200
    # The default here: the agent API is reached on loopback, a one-machine cluster.
    default = agent_api_factory()
    assert post(default, creds, "loop-node", payload(mgmt_addr="127.0.1.5")).status_code == 200
    assert Node.objects.get(name="loop-node").mgmt_addr == "127.0.1.5"


def test_urls_are_built_from_parts():
    from agent.protocol import http_url, mgmt_addr_problem

    assert http_url("10.0.0.1", 8000, "/health") == "http://10.0.0.1:8000/health"
    assert http_url("2001:db8::1", 8000) == "http://[2001:db8::1]:8000"
    for bad in (PROBE, "10.0.0.1:80", "a/b"):
        with pytest.raises(ValueError):
            http_url(bad, 8000)
    with pytest.raises(ValueError):
        http_url("10.0.0.1", 70000)
    assert mgmt_addr_problem("node01.example", hostnames=True) == ""
    assert mgmt_addr_problem("127.0.0.1", loopback=False)


def test_onboarding_refuses_a_mgmt_addr_that_is_not_an_address():
    from provisioning.onboard.request import onboard_request_check
    from provisioning.validation import RequestInvalid

    base = {"node": "onb-a", "addr": "10.0.0.9", "host_key_fingerprint": ""}
    assert onboard_request_check(base)["mgmt_addr"] == "10.0.0.9"
    with pytest.raises(RequestInvalid) as refused:
        onboard_request_check({**base, "mgmt_addr": PROBE})
    assert set(refused.value.errors) == {"mgmt_addr"}
    # A host name reaches the node over SSH, but is not its mgmt_addr unless allowed.
    with pytest.raises(RequestInvalid) as refused:
        onboard_request_check({**base, "addr": "node-a.example"})
    assert "defaults to addr" in refused.value.errors["mgmt_addr"]
    assert onboard_request_check({**base, "addr": "node-a.example", "mgmt_addr": "10.0.0.9"})["addr"] == "node-a.example"
