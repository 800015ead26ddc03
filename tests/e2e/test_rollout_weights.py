"""A rollout to new weights, end to end: real agents with weights caches,
sim engines, a loopback file server (tests.weightservers) and the gateway
under load. The new revision's weights are staged on the nodes before any
replacement is placed, so the replacements start from local weights (never
``staging``); a source whose files never verify fails the rollout with the
old replicas serving."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import httpx
import pytest

from cli.simcluster import SimNode
from cli.wait import wait_until
from core.models import Event
from replicas.catalog import catalog_apply
from replicas.choices import ReplicaStatus, RolloutStatus
from replicas.models import CachedWeights, Replica, Rollout, StagedWeights
from tests.e2e.sim import fast_env
from tests.e2e.test_drain_traffic import Traffic
from tests.weightservers import WeightsServer

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

NODES = [SimNode("node01", "127.0.1.1", fabric="ib-a"), SimNode("node02", "127.0.1.2", fabric="ib-a"),
         SimNode("node03", "127.0.1.3", fabric="ib-a")]


def _files(tag: str) -> dict[str, bytes]:
    return {"config.json": b'{"architectures": ["Sim"], "tag": "%s"}' % tag.encode(),
            "model-00001.safetensors": hashlib.sha256(tag.encode()).digest() * 20000}


def _went_through(replica_id: int) -> list[tuple[str, str]]:
    return [(d["from"], d["to"]) for d in Event.objects.filter(kind="replica.status", subject=f"replica/{replica_id}")
            .order_by("pk").values_list("data", flat=True) if "from" in d]


def _engine_pids(cluster, replica: Replica) -> dict[str, list[int]]:
    return {m.node.name: cluster.engine_pids(m.node.name) for m in replica.members.select_related("node")}


def test_new_weights_are_staged_before_any_replacement_and_a_bad_source_fails_with_the_old_serving(
        sim_cluster, web_factory):
    env = {"LLMGW_ROLLOUT_STAGING_GRACE": "3"}
    with WeightsServer() as server:
        v1 = server.add_files("m1", _files("v1"), revision="v1")
        cluster = sim_cluster(NODES, agent_timings={"weights": {"cache_dir": "weights", "budget": "1G"}}, **env)
        web = web_factory(LLMGW_GATEWAY_OPEN="1", **fast_env(), **env)
        entry = {"name": "m", "engine": "sim", "model": "/models/m", "nodes": 1, "gpus_per_node": 8,
                 "replicas": 2, "source": {"kind": "http", "url": v1}}
        catalog_apply(entries=[entry])
        wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).count() == 2, timeout=90,
                   message="two ready replicas on v1")
        wait_until(lambda: httpx.get(f"{web.url}/v1/models", timeout=5).json()["data"], timeout=10,
                   message="the gateway to route the model")
        originals = {r.pk: r for r in Replica.objects.filter(status=ReplicaStatus.READY)}
        pids = {pk: _engine_pids(cluster, r) for pk, r in originals.items()}

        # 1. A new weights revision: staged on the three nodes (the two
        # originals' and the free one a surge lands on) before any replacement.
        server.rate = 300_000  # ~0.6 MB per node: a couple of seconds of staging to watch
        v2 = server.add_files("m2", _files("v2"), revision="v2")
        waits = []
        with Traffic(web.url, threads=2, model="m") as traffic:
            traffic.wait_served(5, what="before the change")
            catalog_apply(entries=[{**entry, "source": {"kind": "http", "url": v2}}])

            def staged():
                # The replicas first, the rollout after: the rollout says "staged" before any
                # replacement is made, so a replacement seen here with the rollout still staging
                # is a fault, not a read that straddled the moment staging ended.
                replaced = Replica.objects.filter(revision__number=2).exists()
                ready = {r.pk for r in Replica.objects.filter(status=ReplicaStatus.READY)}
                now = {pk: _engine_pids(cluster, r) for pk, r in originals.items()}
                r = Rollout.objects.first()
                if r is None or (r.staging or {}).get("done"):
                    return r is not None
                # While it stages: no replacement, the originals serving, unrestarted.
                if r.waiting_for:
                    waits.append(r.waiting_for)
                if replaced or ready != set(originals) or now != pids:
                    meanwhile.append((r.staging, ready, now))
                return False
            meanwhile = []
            wait_until(staged, timeout=60, message="the new weights staged", interval=0.1)
            rollout = Rollout.objects.first()
            assert meanwhile == [] and len(waits) >= 3, (meanwhile, waits)
            # No replacement before they were staged (the same clock: one machine).
            for replica in Replica.objects.filter(revision__number=2):
                assert replica.created_at.timestamp() >= rollout.staging["done"] - 0.01, (replica, rollout.staging)
            wait_until(lambda: Rollout.objects.first().status == RolloutStatus.DONE, timeout=120,
                       message="the rollout done")
            traffic.wait_served(5, after=time.monotonic(), what="after the rollout")
        assert traffic.failures() == []
        assert any(w.startswith("staging weights m@v2: ") and " of 3 nodes, " in w for w in waits), waits
        assert sorted(rollout.staging["nodes"]) == ["node01", "node02", "node03"]
        for node in ("node01", "node02", "node03"):
            assert CachedWeights.objects.get(node__name=node, model="m", revision="v2").complete
        log = Rollout.objects.first().log
        staged_at = next(i for i, line in enumerate(log) if "weights m@v2 staged on node01, node02, node03" in line)
        first_replacing = next(i for i, line in enumerate(log) if "replacing replica" in line)
        assert staged_at < first_replacing, log
        replacements = list(Replica.objects.filter(revision__number=2, status=ReplicaStatus.READY))
        assert len(replacements) == 2
        for replica in replacements:
            moves = _went_through(replica.pk)
            assert ("scheduled", "starting") in moves and ("scheduled", "staging") not in moves, moves
            for member in replica.members.select_related("node"):
                path = cluster.nodes[member.node.name].dir / "weights" / "m" / "v2"
                cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in cluster.engine_pids(member.node.name)]
                assert any(str(path).encode() in cmd for cmd in cmdlines), cmdlines
        assert not StagedWeights.objects.filter(why=StagedWeights.Why.ROLLOUT).exists()

        # 2. A source whose files never match their sha256: the rollout fails
        # after the grace, no replacement was ever placed, v2 keeps serving.
        serving = {r.pk for r in replacements}
        v3 = server.add_files("m3", _files("v3"), revision="v3")
        for name in _files("v3"):
            server.fault(f"/files/m3/{name}", corrupt=True, times=10**6)
        with Traffic(web.url, threads=2, model="m") as traffic:
            traffic.wait_served(5, what="before the bad change")
            catalog_apply(entries=[{**entry, "source": {"kind": "http", "url": v3}}])
            wait_until(lambda: Rollout.objects.first().status == RolloutStatus.FAILED, timeout=90,
                       message=f"the rollout to fail ({Rollout.objects.first().waiting_for})")
            traffic.wait_served(5, after=time.monotonic(), what="after the rollout failed")
        assert traffic.failures() == []
        failed = Rollout.objects.first()
        assert "the new weights could not be staged" in failed.status_reason, failed.status_reason
        assert "cannot stage m@v3" in failed.status_reason and "sha256 mismatch" in failed.status_reason
        assert "the old replicas keep serving" in failed.status_reason
        assert not Replica.objects.filter(revision__number=3).exists()
        assert {r.pk for r in Replica.objects.filter(status=ReplicaStatus.READY)} == serving
        assert not StagedWeights.objects.filter(why=StagedWeights.Why.ROLLOUT).exists()
