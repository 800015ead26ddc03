"""A node's certificate renews itself while its engine serves: the agent
switches identity in place, its engine keeps its process and its replica
stays ready through the renewal (a real agent, a real sim engine, the real
agent API, worker and beat)."""

from __future__ import annotations

import datetime as dt
import os

import pytest

from agent.identity import csr_make, key_ensure
from cli.simcluster import SimNode
from cli.wait import wait_until
from core.models import Event
from pki.models import Certificate
from pki.signing import cert_sign_node
from replicas.catalog import catalog_apply
from replicas.choices import ReplicaStatus
from replicas.models import Member, Replica

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LIFETIME = 24  # seconds: the agent renews at two thirds of it


def alive(pid: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except (OSError, TypeError):
        return False
    return True


def short_lived(name, out):
    """The node's own key and a certificate of LIFETIME seconds."""
    key = key_ensure(out / f"{name}-key.pem", fresh=True)
    signed = cert_sign_node(node_id=name, csr_pem=csr_make(node_id=name, key=key),
                            lifetime=dt.timedelta(seconds=LIFETIME))
    (out / f"{name}.pem").write_bytes(signed.cert_pem)
    (out / "ca.pem").write_bytes(signed.ca_pem)


def test_a_renewal_keeps_the_engine_running_and_the_replica_ready(sim_cluster):
    cluster = sim_cluster(nodes=[], LLMGW_NODE_CERT_SECONDS=str(LIFETIME))
    node = cluster.add_node(SimNode("rot-eng01", "127.0.1.1", gpus=2, fabric="ib-a"), issue_cert=short_lived)
    [first] = Certificate.objects.filter(common_name="rot-eng01")
    agent = cluster.start_agent("rot-eng01")
    catalog_apply(entries=[{"name": "tiny", "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 1,
                            "replicas": 1}])
    wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).exists(), timeout=LIFETIME / 2,
               message="the replica ready before the renewal")
    member = Member.objects.select_related("replica").get(replica__status=ReplicaStatus.READY)
    assert alive(member.pid)
    became_ready = Event.objects.filter(subject=f"replica/{member.replica_id}", data__to="ready").count()

    wait_until(lambda: Certificate.objects.get(pk=first.pk).revoked_at is not None, timeout=LIFETIME,
               message="the agent to renew its certificate")
    renewed = Certificate.objects.get(pk=first.pk)
    assert renewed.revocation_reason.startswith("superseded by ")
    log = node.dir / "agent.log"
    wait_until(lambda: "certificate renewed: now serial" in log.read_text(), timeout=10,
               message="the agent to say it switched")
    # Heartbeats go on over the new identity for a while (past the old one's end).
    new = Certificate.objects.get(serial=renewed.revocation_reason.split()[-1])
    wait_until(lambda: Member.objects.get(pk=member.pk).replica.status == ReplicaStatus.READY
               and dt.datetime.now(dt.timezone.utc) > first.not_after, timeout=LIFETIME,
               message="the first certificate's lifetime to pass")
    assert agent.poll() is None, "the agent was not restarted"
    now = Member.objects.select_related("replica").get(pk=member.pk)
    assert now.pid == member.pid and alive(member.pid), "the engine kept its process"
    assert now.replica.status == ReplicaStatus.READY
    # Never left ready: no status change of the replica since it became ready.
    assert Event.objects.filter(subject=f"replica/{member.replica_id}", kind="replica.status").exclude(
        data__to="ready").filter(created_at__gt=new.issued_at).count() == 0
    assert Event.objects.filter(subject=f"replica/{member.replica_id}", data__to="ready").count() == became_ready
    assert "refused this agent" not in log.read_text()
