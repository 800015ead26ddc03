"""A real agent with a simulated node's fake NVML: telemetry blocks ride on
heartbeats at most every telemetry interval, utilisation follows the sim
engine's load, and an injected Xid reaches the control plane at once."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from agent.nvml_fake import inject_fault
from cli.wait import wait_until
from tests.conftest import free_port

from .test_agent_engines import healthy_engine
from .conftest import sim_member

pytestmark = pytest.mark.django_db


def test_telemetry_rides_on_heartbeats_follows_load_and_an_xid_comes_at_once(
    fake_control_plane, sim_node, agent_factory
):
    plane = fake_control_plane(heartbeat_interval=1)
    config = sim_node("node01", server=plane.url, gpus=2, telemetry={"interval": "5s"})
    agent_factory(config)
    first = plane.wait_heartbeat("node01", lambda b: b.get("telemetry"), 20)
    block = first["telemetry"]
    assert block["source"] == "sim" and [g["index"] for g in block["gpus"]] == [0, 1]
    assert block["gpus"][0]["util"] == 0 and block["gpus"][0]["power_limit_w"] == 700.0
    # At most one block per interval: heartbeats every second, blocks every 5 s.
    time.sleep(4.5)
    with plane.cond:
        beats = list(plane.heartbeats["node01"])
    blocks = [b for b in beats if b.get("telemetry")]
    assert len(beats) >= 4 and len(blocks) <= 2

    http = free_port()
    plane.set_members("node01", [sim_member("m1", http_port=http, gpus=(1,))])
    plane.wait_heartbeat("node01", healthy_engine("m1"), 20)
    stop = threading.Event()

    def keep_asking():
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                client.post(f"http://127.0.0.1:{http}/v1/completions",
                            json={"model": "sim-model", "prompt": "hi", "max_tokens": 2000})

    threads = [threading.Thread(target=keep_asking) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        # Requests in flight while the GPU is read: the leader's load shows as its GPU's utilisation.
        busy = plane.wait_heartbeat("node01", lambda b: b.get("telemetry")
                                    and (b["telemetry"]["gpus"][1]["util"] or 0) > 5, 20)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert busy["telemetry"]["gpus"][0]["util"] == 0
    assert busy["telemetry"]["gpus"][1]["mem_used_mib"] > 100_000

    count = len(plane.heartbeats["node01"])
    injected = time.monotonic()
    inject_fault(config.parent, {"gpu": 0, "xid": 48})
    beat = plane.wait_heartbeat("node01", lambda b: b.get("telemetry") and b["telemetry"]["gpus"][0]["xids"],
                                10, since=count)
    assert time.monotonic() - injected < 4, "an Xid must not wait for the telemetry interval"
    assert beat["telemetry"]["gpus"][0]["xids"] == [48]
    # Taken by the control plane once: the next block no longer carries it.
    later = plane.wait_heartbeat("node01", lambda b: b.get("telemetry"), 12, since=len(plane.heartbeats["node01"]))
    assert later["telemetry"]["gpus"][0]["xids"] == [] and later["telemetry"]["gpus"][0]["last_xid"] == 48
