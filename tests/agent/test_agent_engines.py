"""A real agent process running engines for a control plane that asks for them.

The control plane here is the fake of ``fake_control_plane`` (real mTLS, the
real protocol), because the real one does not schedule members yet.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from agent.proc import process_identity
from tests.conftest import free_port

from .conftest import listening_ports, sim_member, wait_until

pytestmark = pytest.mark.django_db


def engine(beat: dict, member: str) -> dict | None:
    return next((e for e in beat["engines"] if e["member"] == member), None)


def healthy_engine(member: str):
    return lambda beat: (e := engine(beat, member)) is not None and e["healthy"]


def serving(port: int, host: str = "127.0.0.1") -> bool:
    try:
        return httpx.get(f"http://{host}:{port}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def sim_processes(port: int) -> list[int]:
    """Pids of sim engines serving on ``port``, found by their command line."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent.engines.sim" in argv and str(port).encode() in argv:
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
            if state != "Z":
                pids.append(int(proc.name))
    return pids


def test_desired_state_arrives_by_long_poll_and_engine_changes_are_reported_at_once(
    fake_control_plane, sim_node, agent_factory
):
    # Heartbeats every 30 s: they cannot be what carries the changes below.
    plane = fake_control_plane(heartbeat_interval=30)
    agent = agent_factory(sim_node("node01", server=plane.url, heartbeat_interval="30s"))
    plane.wait_heartbeat("node01", lambda beat: True, 20)
    wait_until(lambda: plane.polls >= 1, 10, message="agent waiting on the long-poll")

    http = free_port()
    version = plane.set_members("node01", [sim_member("m1", http_port=http, gpus=(0, 1))])
    # Within 15 s: the next 30 s heartbeat is not what brings it.
    beat = plane.wait_heartbeat("node01", healthy_engine("m1"), 15)
    state = engine(beat, "m1")
    assert beat["desired_version"] == version
    assert state["state"] == "running" and state["rank"] == 0 and state["replica"] == "r1"
    assert any("serving model sim-model" in line for line in state["log_tail"])
    assert serving(http)

    plane.set_members("node01", [])
    plane.wait_heartbeat("node01", lambda beat: beat["engines"] == [] and beat["desired_version"] == version + 1, 15)
    wait_until(lambda: not sim_processes(http), 10, message="engine stopped")
    assert "engine stopping member=m1" in agent.log()


def test_engines_keep_running_while_the_control_plane_is_away(fake_control_plane, sim_node, agent_factory):
    plane = fake_control_plane(heartbeat_interval=1)
    agent = agent_factory(sim_node("node01", server=plane.url))
    http = free_port()
    plane.set_members("node01", [sim_member("m1", http_port=http)])
    pid = engine(plane.wait_heartbeat("node01", healthy_engine("m1"), 20), "m1")["pid"]

    plane.stop()
    agent.wait_for_log("control plane unreachable")
    # The scenario: away for a while. Nothing outside the agent shows its
    # attempts; they are counted once it is back.
    time.sleep(3)
    assert serving(http) and sim_processes(http) == [pid], "engines untouched"

    # Back, with the same desired state (a control plane that lost it would
    # rightly have the engine stopped).
    again = fake_control_plane(port=plane.port, heartbeat_interval=1, desired=plane.desired)
    beat = again.wait_heartbeat("node01", healthy_engine("m1"), 20)
    assert engine(beat, "m1")["pid"] == pid
    log = agent.wait_for_log("control plane reachable again")
    attempts = re.search(r"reachable again at \S+ after (\d+) failed attempts", log)
    assert attempts and int(attempts[1]) >= 2, "it was away through several attempts"
    # Several attempts failed, and one line said so: a state change, not every retry.
    assert log.count("control plane unreachable") == 1
    assert agent.log().count("engine started") == 1


def test_a_restarted_agent_adopts_its_engines(fake_control_plane, sim_node, agent_factory):
    plane = fake_control_plane(heartbeat_interval=1)
    config = sim_node("node01", server=plane.url)
    first = agent_factory(config)
    http = free_port()
    version = plane.set_members("node01", [sim_member("m1", http_port=http)])
    pid = engine(plane.wait_heartbeat("node01", healthy_engine("m1"), 20), "m1")["pid"]

    assert first.stop(signal.SIGTERM) == 0
    assert "engines left running" in first.log()
    assert serving(http) and process_identity(pid) is not None

    beats_before = len(plane.heartbeats["node01"])
    second = agent_factory(config)
    second.wait_for_log("adopted 1 running engine(s): m1(pid %d)" % pid)
    # Once it holds the desired state again (and has converged to it):
    beat = plane.wait_heartbeat(
        "node01", lambda b: healthy_engine("m1")(b) and b["desired_version"] == version, 20, since=beats_before)
    assert engine(beat, "m1")["pid"] == pid
    assert sim_processes(http) == [pid], "the same engine, not a second one"
    assert "engine started" not in second.log()


def test_a_two_node_replica_across_two_agents(fake_control_plane, sim_node, agent_factory):
    """The sequence of the seeds' simulated cluster: a leader that waits for its
    worker, a worker with no port open, and a group that breaks as a whole."""
    plane = fake_control_plane(heartbeat_interval=1)
    agent_factory(sim_node("node01", server=plane.url, fabrics=["ib-a:mlx5_0,mlx5_1"], addr="127.0.1.1"))
    agent_factory(sim_node("node02", server=plane.url, fabrics=["ib-a:mlx5_0,mlx5_1"], addr="127.0.1.2"))
    http, rendezvous = free_port("127.0.1.1"), free_port("127.0.1.1")
    common = dict(nnodes=2, rendezvous=f"127.0.1.1:{rendezvous}", fabric="ib-a", replica="r7")
    plane.set_members("node01", [sim_member("r7-0", http_port=http, host="127.0.1.1", rank=0, **common)])

    leader = engine(plane.wait_heartbeat("node01", lambda b: (e := engine(b, "r7-0")) and e["pid"], 20), "r7-0")
    wait_until(lambda: rendezvous in listening_ports(leader["pid"]), 15, message="the leader waiting on its rendezvous")
    assert not serving(http, "127.0.1.1"), "the leader waits for its worker"
    assert engine(plane.last_heartbeat("node01"), "r7-0")["state"] == "starting"

    plane.set_members("node02", [sim_member("r7-1", http_port=http, host="127.0.1.1", rank=1, **common)])
    plane.wait_heartbeat("node01", healthy_engine("r7-0"), 20)
    worker = plane.wait_heartbeat("node02", lambda b: (e := engine(b, "r7-1")) and e["state"] == "running", 20)
    worker_pid = engine(worker, "r7-1")["pid"]
    assert listening_ports(worker_pid) == set()

    leader_pid = engine(plane.last_heartbeat("node01"), "r7-0")["pid"]
    os.kill(worker_pid, signal.SIGKILL)
    lead = plane.wait_heartbeat("node01", lambda b: (e := engine(b, "r7-0")) is not None and e["state"] == "exited", 20)
    assert engine(lead, "r7-0")["exit_code"] == 1 and engine(lead, "r7-0")["pid"] == leader_pid
    assert any("group broken" in line for line in engine(lead, "r7-0")["log_tail"])
    gone = plane.wait_heartbeat("node02", lambda b: (e := engine(b, "r7-1")) is not None and e["state"] == "exited", 20)
    assert engine(gone, "r7-1")["exit_code"] == -signal.SIGKILL
