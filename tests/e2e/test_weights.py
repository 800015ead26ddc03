"""Weights end to end: real agents with weights caches fetch a model's files
from a loopback file server over a slow link; the replica goes staging ->
starting -> ready, and its sim engines start with the local path. The sim
engine refuses to start without its files."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from cli.simcluster import SimNode
from cli.wait import wait_until
from core.models import Event
from replicas.catalog import catalog_apply
from replicas.choices import ReplicaStatus
from replicas.models import CachedWeights, Member, Replica
from tests.conftest import REPO
from tests.weightservers import WeightsServer

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

FILES = {"config.json": b'{"architectures": ["Sim"]}',
         "model-00001.safetensors": hashlib.sha256(b"1").digest() * 20000,
         "model-00002.safetensors": hashlib.sha256(b"2").digest() * 20000}


def test_staging_then_starting_then_ready_with_the_local_path(sim_cluster, tmp_path):
    with WeightsServer() as server:
        server.rate = 400_000  # ~1.3 MB per node at 400 kB/s: a few seconds of staging to watch
        url = server.add_files("m", FILES, revision="v1")
        cluster = sim_cluster([SimNode("node01", "127.0.1.1", fabric="ib-a"),
                               SimNode("node02", "127.0.1.2", fabric="ib-a")],
                              agent_timings={"weights": {"cache_dir": "weights", "budget": "1G"}})
        catalog_apply(entries=[{"name": "m", "engine": "sim", "model": "/models/m", "nodes": 2, "gpus_per_node": 8,
                                "replicas": 1, "source": {"kind": "http", "url": url}}])
        wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.STAGING).exists(), timeout=30,
                   message="the replica staging")
        wait_until(lambda: 0 < (Replica.objects.get().staging or {}).get("bytes", 0) < 2 * sum(map(len, FILES.values())),
                   timeout=30, message="staging progress reported")
        wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).exists(), timeout=90,
                   message="the replica ready")
    replica = Replica.objects.get()
    moves = [(e["from"], e["to"]) for e in Event.objects.filter(kind="replica.status", data__has_key="from")
             .order_by("pk").values_list("data", flat=True)]
    assert moves == [("pending", "scheduled"), ("scheduled", "staging"), ("staging", "starting"),
                     ("starting", "ready")]
    assert Event.objects.filter(kind="weights", message__contains="% staged").exists()
    for member in Member.objects.filter(replica=replica).select_related("node"):
        cached = CachedWeights.objects.get(node=member.node, model="m", revision="v1")
        assert cached.complete and cached.bytes == sum(map(len, FILES.values()))
        path = cluster.nodes[member.node.name].dir / "weights" / "m" / "v1"
        for name, data in FILES.items():
            assert (path / name).read_bytes() == data
        cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in cluster.engine_pids(member.node.name)]
        assert any(str(path).encode() in cmd for cmd in cmdlines), cmdlines


def test_the_sim_engine_refuses_to_start_without_its_files(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "agent.engines.sim", "--rank", "0", "--nnodes", "1",
                              "--model", "m", "--port", "0", "--weights", str(tmp_path / "nothing")],
                             cwd=REPO, capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2 and "no model weights at" in missing.stderr
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / ".complete").write_text('{"files": [{"name": "a.bin", "size": 3}]}')
    (weights / "a.bin").write_bytes(b"ab")  # truncated
    short = subprocess.run([sys.executable, "-m", "agent.engines.sim", "--rank", "0", "--nnodes", "1",
                            "--model", "m", "--port", "0", "--weights", str(weights)],
                           cwd=REPO, capture_output=True, text=True, timeout=30)
    assert short.returncode == 2 and "no model weights at" in short.stderr
