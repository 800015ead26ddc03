"""A real agent process against the real control plane (agent API over mTLS, web API)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from nodes import liveness
from nodes.models import Node
from tests.conftest import REPO

from .conftest import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def ctl_nodes(web, token: str) -> dict[str, dict]:
    env = dict(os.environ, LLMGW_URL=web.url, LLMGW_TOKEN=token)
    done = subprocess.run(
        [sys.executable, "-m", "cli", "ctl", "nodes", "-o", "json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return {n["name"]: n for n in json.loads(done.stdout)}


def ready(*names: str) -> bool:
    return Node.objects.filter(name__in=names, status="ready").count() == len(names)


def test_agents_register_and_show_their_gpus_fabric_and_discovery_errors(
    agent_api_factory, web_factory, admin_token, sim_node, agent_factory
):
    api = agent_api_factory(LLMGW_HEARTBEAT_INTERVAL="1")
    web = web_factory()
    good = sim_node("node01", server=api.url, gpus=4, fabrics=["ib-a:mlx5_0,mlx5_1"], addr="127.0.1.1")
    broken = sim_node("node02", server=api.url, gpus=2, addr="127.0.1.2")
    smi = broken.parent / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'Failed to initialize NVML: Driver/library version mismatch' >&2\nexit 18\n")
    agent = agent_factory(good)
    agent_factory(broken)
    wait_until(lambda: ready("node01", "node02"), 30, interval=0.2, message="both nodes ready")
    assert "long-poll" not in agent.log(), "the control plane's long-poll answers this agent"

    nodes = ctl_nodes(web, admin_token)
    node01, node02 = nodes["node01"], nodes["node02"]
    assert node01["status"] == "ready" and node01["mgmt_addr"] == "127.0.1.1"
    assert node01["fabrics"] == ["ib-a"]
    assert [g["index"] for g in node01["gpus"]] == [0, 1, 2, 3]
    assert {g["name"] for g in node01["gpus"]} == {"NVIDIA H200"}
    assert [(h["name"], h["fabric"], h["state"], h["rate"]) for h in node01["hcas"]] == [
        ("mlx5_0", "ib-a", "ACTIVE", "400 Gb/sec (4X NDR)"), ("mlx5_1", "ib-a", "ACTIVE", "400 Gb/sec (4X NDR)"),
    ]
    assert node01["discovery_errors"] == [] and node01["agent_version"] == "0.1.0"

    # A broken nvidia-smi is not "no GPUs": the node says why it has none.
    assert node02["gpus"] == [] and node02["fabrics"] == []
    (error,) = node02["discovery_errors"]
    assert "exited with status 18: Failed to initialize NVML: Driver/library version mismatch" in error


def test_a_certificate_for_another_node_is_refused_and_the_agent_says_so(agent_api_factory, sim_node, agent_factory):
    api = agent_api_factory()
    agent = agent_factory(sim_node("node07", server=api.url, cert_for="node08"))
    log = agent.wait_for_log("control plane refused this agent (403)")
    assert "this certificate is for node 'node08', not 'node07'" in log
    # It keeps trying at the slowest rate (reconnect_max, 1 s here), saying so once.
    wait_until(lambda: api.log().count("certificate cn=node08") >= 3, 20, interval=0.2, message="retries")
    assert agent.log().count("refused this agent") == 1
    assert agent.proc.poll() is None
    assert not Node.objects.filter(name__in=["node07", "node08"]).exists()


def test_the_control_plane_going_away_and_coming_back(agent_api_factory, sim_node, agent_factory):
    api = agent_api_factory(LLMGW_HEARTBEAT_INTERVAL="1")
    agent = agent_factory(sim_node("node01", server=api.url))
    agent.wait_for_log("control plane reachable at")
    wait_until(lambda: ready("node01"), 20, interval=0.2, message="node ready")

    api.stop()
    agent.wait_for_log("control plane unreachable")
    # The scenario: away for a while, several attempts backing off between
    # 200 ms and 1 s. Nothing outside the agent shows them: they are counted
    # below, once it is back.
    time.sleep(3)
    assert agent.proc.poll() is None

    back = time.time()
    agent_api_factory(port=api.port, LLMGW_HEARTBEAT_INTERVAL="1")
    log = agent.wait_for_log("control plane reachable again", timeout=20)
    attempts = re.search(r"reachable again at \S+ after (\d+) failed attempts", log)
    assert attempts and int(attempts[1]) >= 2, "it was away through several attempts"
    # Those attempts failed, and one line said so.
    assert log.count("control plane unreachable") == 1, "a state change is logged once, not every retry"
    wait_until(lambda: liveness.store().seen_all().get("node01", 0) > back, 10, interval=0.2, message="heartbeats")
