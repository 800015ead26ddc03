"""Fixtures of the agent-contract tests: a node with a placed member, whose
heartbeats go through the agent API's view (tests/agent_view.py)."""

from __future__ import annotations

import pytest

from agent.protocol import example_heartbeat
from replicas import reconcile
from replicas.models import Member
from tests.agent_view import peer_for, send_heartbeat
from tests.factories import CatalogEntryFactory


ENGINE = {"member": "m1", "replica": "1", "rank": 0, "state": "running", "pid": 4242, "exit_code": None,
          "healthy": True, "log_tail": ["ready"]}


def heartbeat_template() -> dict:
    """The shape of the heartbeats these tests send: two GPUs, one fabric with
    two HCAs, one engine (its member and replica ids are the placed ones)."""
    return {**example_heartbeat(gpus=2, fabric="ib-a").to_dict(), "engines": [dict(ENGINE)]}


@pytest.fixture
def placed(db, pki_dir, no_reconcile_enqueue):
    """node01, registered by a heartbeat, with one member of a replica on it;
    returns (peer socket, a well-formed heartbeat reporting that member)."""
    peer = peer_for("node01")
    body = heartbeat_template()
    body["engines"] = []
    status, reply = send_heartbeat(peer, "node01", body)
    assert status == 200, reply
    CatalogEntryFactory(name="m", nodes=1, gpus_per_node=1, replicas=1)
    reconcile.replicas_reconcile()
    member = Member.objects.get()
    body["engines"] = [dict(ENGINE, member=member.member_id, replica=str(member.replica_id))]
    status, reply = send_heartbeat(peer, "node01", body)
    assert status == 200, reply
    return peer, body
