"""Engines do not run as root: a root agent starts them as its engine_user
(issue 19, item 1a). The agent here is a real process running as root (the
suite runs as root), its engine a real sim engine."""

from __future__ import annotations

import os
import pwd
import subprocess
import sysconfig
from pathlib import Path

import pytest

from agent.config import ConfigError, load_config
from tests.conftest import REPO, free_port

from .conftest import AgentProcess, sim_member, wait_until, write_yaml

pytestmark = [pytest.mark.django_db,
              pytest.mark.skipif(os.geteuid() != 0, reason="starting engines as another user needs a root agent")]

# An unprivileged user every Linux has. The test's interpreter lives under
# /root (0700 here), which no other user may execute: the agent runs under
# the system's Python with the venv's packages on its path, as an installed
# agent runs from /opt/llmgw-agent/venv.
ENGINE_USER = "nobody"
SYSTEM_PYTHON = "/usr/bin/python3"
AGENT = "import sys; from agent.cli import agent_command; sys.exit(agent_command())"  # llmgw-agent


def status_ids(pid: int) -> dict[str, list[int]]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            fields[key] = [int(v) for v in value.split()]
    return fields


@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs a system python3 others can run")
def test_a_root_agent_starts_its_engines_as_the_engine_user(fake_control_plane, sim_node, tmp_path):
    nobody = pwd.getpwnam(ENGINE_USER)
    plane = fake_control_plane(heartbeat_interval=30)
    config = sim_node("node01", server=plane.url, heartbeat_interval="30s")
    write_yaml(config, engine_user=ENGINE_USER)
    agent = AgentProcess(config, tmp_path / "agent.log")
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{sysconfig.get_paths()['purelib']}", PYTHONUNBUFFERED="1")
    with open(agent.log_path, "ab") as log:
        agent.proc = subprocess.Popen([SYSTEM_PYTHON, "-c", AGENT, "run", "--config", str(config)], cwd=REPO,
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        agent.wait_for_log(f"engines run as user {ENGINE_USER}")
        http = free_port()
        plane.set_members("node01", [sim_member("m1", http_port=http)])
        beat = plane.wait_heartbeat(
            "node01", lambda b: any(e["member"] == "m1" and e["healthy"] for e in b["engines"]), 30)
        (state,) = beat["engines"]
        ids = status_ids(state["pid"])
        # Real, effective, saved and file-system ids: all the engine user's, and no group of root's.
        assert ids["Uid"] == [nobody.pw_uid] * 4, ids
        assert ids["Gid"] == [nobody.pw_gid] * 4, ids
        assert 0 not in ids["Groups"], ids
        assert status_ids(agent.proc.pid)["Uid"][0] == 0  # the agent itself is root
        # Its working directory is its own; its record and log stay the agent's.
        member_dir = Path(os.readlink(f"/proc/{state['pid']}/cwd")).parent
        assert os.readlink(f"/proc/{state['pid']}/cwd").endswith("/m1/work")
        assert os.stat(member_dir / "work").st_uid == nobody.pw_uid
        assert os.stat(member_dir / "engine.json").st_uid == 0 and os.stat(member_dir).st_uid == 0
    finally:
        plane.set_members("node01", [])
        agent.stop()


def test_an_engine_user_that_is_missing_or_root_is_a_configuration_error(sim_node, tmp_path):
    config = sim_node("node01", server="https://127.0.0.1:7443")
    for user, says in (("llmgw-no-such-user", "does not exist on this node; create it (useradd --system"),
                       ("root", "is root (uid 0)"), ("Bad User", "is not a user name")):
        write_yaml(config, engine_user=user)
        with pytest.raises(ConfigError) as caught:
            load_config(config)
        assert any(e.startswith("engine_user:") and says in e for e in caught.value.errors), caught.value.errors
    write_yaml(config, engine_user=ENGINE_USER)
    assert load_config(config).supervisor.engine_user == ENGINE_USER


def test_without_engine_user_a_root_agent_says_its_engines_run_as_root(caplog, tmp_path):
    from agent.config import SupervisorConfig
    from agent.supervisor import Supervisor

    supervisor = Supervisor(SupervisorConfig(work_dir=tmp_path / "work"))
    try:
        assert supervisor.engine_user is None
        assert "engines run as root: set engine_user" in caplog.text
    finally:
        supervisor.close()

