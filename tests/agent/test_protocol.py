"""The contract between agent and control plane tolerates a newer other side.

A control plane upgraded before its agents (or the other way round) may send
fields the reader does not know. The reader ignores them: an older agent must
keep running engines when the server adds a field.
"""

from __future__ import annotations

import dataclasses

import pytest

from agent import protocol
from agent.client import ControlPlaneClient
from agent.config import load_config
from agent.protocol import DesiredState, EngineState, Heartbeat, HeartbeatReply, example_heartbeat
from tests.conftest import free_port, mtls_client

from .conftest import sim_member

pytestmark = pytest.mark.django_db

NEWER = {"placement_hint": {"zone": "b"}, "drain_deadline": 1234.5}


def test_unknown_fields_are_ignored_at_every_level():
    member = {**dataclasses.asdict(sim_member("m1", http_port=9)), **NEWER}
    reply = HeartbeatReply.from_dict({
        "node": "node01", "status": "ready", "heartbeat_interval": 5, **NEWER,
        "desired": {"version": "4", "members": [member], **NEWER},
    })
    assert reply.heartbeat_interval == 5.0
    assert reply.desired.version == 4
    assert reply.desired.members == [sim_member("m1", http_port=9)]

    beat = example_heartbeat().to_dict()
    beat["gpus"][0]["temperature_c"] = 41
    beat["hcas"][0]["numa_node"] = 1
    beat["fabrics"][0]["subnet_manager"] = "opensm"
    beat["engines"] = [{"member": "m1", "replica": "r1", "rank": 0, "state": "running", "oom_kills": 2}]
    assert Heartbeat.from_dict({**beat, **NEWER}) == Heartbeat(**{
        **example_heartbeat().__dict__,
        "engines": [EngineState(member="m1", replica="r1", rank=0, state="running")],
    })


def test_a_missing_required_field_is_still_an_error():
    with pytest.raises(TypeError, match="version"):
        DesiredState.from_dict({"members": []})
    with pytest.raises(TypeError, match="JSON list"):
        DesiredState.from_dict({"version": 1, "members": None})


def test_contract_constants():
    assert protocol.NODE_ID_RE.match("gpu-node-01.rack2")
    assert not protocol.NODE_ID_RE.match("GPU01") and not protocol.NODE_ID_RE.match("-a")
    assert protocol.MEMBER_ID_RE.match("m12") and not protocol.MEMBER_ID_RE.match("../x")
    assert protocol.node_path("node01") == "/agent/v1/nodes/node01"


def test_the_client_accepts_a_reply_and_a_desired_state_from_a_newer_control_plane(
    fake_control_plane, sim_node, client_cert
):
    plane = fake_control_plane(extra=NEWER)
    plane.set_members("node01", [sim_member("m1", http_port=9)])
    client = ControlPlaneClient(load_config(sim_node("node01", server=plane.url)))
    try:
        reply = client.heartbeat(example_heartbeat())
        assert reply.desired.version == 1 and reply.desired.members == [sim_member("m1", http_port=9)]
        desired = client.desired(version=0, wait=0)
        assert desired == reply.desired
    finally:
        client.close()
    # What the client read did carry the extra fields, at every level.
    with mtls_client(*client_cert("node01"), timeout=10) as raw:
        sent = raw.get(f"{plane.url}/agent/v1/nodes/node01/desired", params={"version": 0, "wait": 0}).json()
    assert sent["drain_deadline"] == 1234.5 and sent["members"][0]["placement_hint"] == {"zone": "b"}


def test_an_agent_runs_what_a_newer_control_plane_asks(fake_control_plane, sim_node, agent_factory):
    plane = fake_control_plane(extra=NEWER, heartbeat_interval=1)
    http = free_port()
    plane.set_members("node01", [sim_member("m1", http_port=http)])
    agent = agent_factory(sim_node("node01", server=plane.url))
    beat = plane.wait_heartbeat(
        "node01", lambda b: any(e["member"] == "m1" and e["healthy"] for e in b["engines"]), 30)
    assert beat["desired_version"] == 1
    assert "does not parse" not in agent.log()
    assert agent.proc.poll() is None
