"""The seeds' run, end to end: four simulated nodes in two fabrics, a 2x4
model with two replicas, node02 killed, the ib-a replica rebuilt on ib-b."""

import json
import os
import urllib.request
from pathlib import Path

import pytest

from cli.wait import wait_until
from core.models import Event
from nodes.choices import NodeStatus
from nodes.models import Node
from replicas.catalog import catalog_apply
from replicas.choices import MemberState, ReplicaStatus
from replicas.models import GpuAllocation, Member, Replica
from tests.conftest import session_processes

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def listening_addresses() -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of a process this test
    session started: another session (a parallel worker, another checkout's
    tests) may run simulated nodes on the same addresses."""
    ours = set()
    for pid in session_processes():
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    ours.add(target[8:-1])
        except OSError:
            continue  # gone meanwhile
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if fields[3] != "0A" or fields[9] not in ours:  # LISTEN, by one of ours
            continue
        hex_addr, hex_port = fields[1].split(":")
        raw = bytes.fromhex(hex_addr)[::-1]
        found.add((".".join(str(b) for b in raw), int(hex_port, 16)))
    return found


def chat(leader: Member, model: str) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}]}).encode()
    request = urllib.request.Request(
        f"http://{leader.node.mgmt_addr}:{leader.ports['http']}/v1/chat/completions",
        data=body, headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def placement(replica: Replica) -> dict[str, list[int]]:
    return {m.node.name: m.gpus for m in replica.members.select_related("node").order_by("rank")}


def test_seeds_scenario(sim_cluster):
    cluster = sim_cluster()
    catalog_apply(entries=[{"name": "llama-70b", "engine": "sim", "model": "/models/llama-70b",
                            "nodes": 2, "gpus_per_node": 4, "replicas": 2}])
    wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).count() == 2, timeout=60,
               message="two ready replicas")
    replicas = {r.fabric.name: r for r in Replica.objects.filter(status=ReplicaStatus.READY)}
    assert list(placement(replicas["ib-a"])) == ["node01", "node02"]
    assert list(placement(replicas["ib-b"])) == ["node03", "node04"]
    assert all(len(gpus) == 4 for r in replicas.values() for gpus in placement(r).values())

    leader = replicas["ib-a"].members.select_related("node").get(rank=0)
    answer = chat(leader, "llama-70b")
    assert answer["choices"][0]["message"]["content"]

    listening = listening_addresses()
    assert ("127.0.1.1", leader.ports["http"]) in listening
    assert not [a for a in listening if a[0] == "127.0.1.2"], "node02 (a worker) must have no open port"

    node01_engine = replicas["ib-a"].members.get(rank=0).pid
    cluster.kill_node("node02")
    wait_until(lambda: Node.objects.get(name="node02").status == NodeStatus.LOST, timeout=GRACE_TIMEOUT,
               message="node02 declared lost")
    failed = Replica.objects.get(pk=replicas["ib-a"].pk)
    wait_until(lambda: Replica.objects.get(pk=failed.pk).status in (ReplicaStatus.FAILED, ReplicaStatus.STOPPED),
               timeout=10, message="the ib-a replica to fail")
    # Reaped: node01's engine stops and its GPUs are freed.
    wait_until(lambda: Replica.objects.get(pk=failed.pk).status == ReplicaStatus.STOPPED, timeout=20,
               message="the failed replica to be reaped")
    assert not _alive(node01_engine)
    assert not GpuAllocation.objects.filter(node__name="node01").exists()
    # A replacement becomes ready on ib-b, the fabric that can still hold it whole.
    wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).count() == 2, timeout=60,
               message="a replacement ready")
    replacement = Replica.objects.filter(status=ReplicaStatus.READY).exclude(pk=replicas["ib-b"].pk).get()
    assert replacement.fabric.name == "ib-b"
    assert list(placement(replacement)) == ["node03", "node04"]
    # node01 sits idle rather than being paired across fabrics.
    assert not Member.objects.filter(node__name="node01").exclude(state=MemberState.GONE).exists()
    assert Event.objects.filter(subject="node/node02", message__contains="lost").exists()


GRACE_TIMEOUT = 20


def _alive(pid: int | None) -> bool:
    import os

    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
