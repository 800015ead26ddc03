"""``llmgw ctl`` against a real web process, as an operator runs it."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from core.choices import CoreEventKind
from core.models import Event
from nodes import liveness
from nodes.choices import NodeEventKind, NodeStatus
from nodes.models import Node
from tests.conftest import REPO, free_port, server_env
from tests.factories import EventFactory, GpuFactory, NodeFactory

pytestmark = pytest.mark.django_db(transaction=True)

LLMGW = str(REPO / ".venv" / "bin" / "llmgw")


def run(*args: str, env: dict[str, str], rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([LLMGW, "ctl", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == rc, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    if rc:
        assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture
def web(web_factory):
    return web_factory()


@pytest.fixture
def ctl_env(web, admin_token, tmp_path):
    return server_env(LLMGW_URL=web.url, LLMGW_TOKEN=admin_token, LLMGW_DATA_DIR=str(tmp_path / "nowhere"))


@pytest.fixture
def cluster():
    node01 = NodeFactory(name="node01", fabrics=["ib-a", "ib-b"])
    for i in range(2):
        GpuFactory(node=node01, index=i)
    node02 = NodeFactory(name="node02", status=NodeStatus.LOST, discovery_errors=["nvidia-smi: not found"])
    Node.objects.filter(pk=node02.pk).update(last_heartbeat_at=None)
    liveness.store().record("node01", time.time() - 3)
    return node01, node02


def test_nodes_table(ctl_env, cluster):
    lines = run("nodes", env=ctl_env).stdout.splitlines()
    assert lines[0].split() == ["node", "state", "fabrics", "gpus", "heartbeat", "replicas", "cache", "weights", "notes"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["node01"][:6] == ["node01", "ready", "ib-a,ib-b", "2", rows["node01"][4], "0"]
    assert rows["node01"][4].endswith("s") and 2 <= int(rows["node01"][4][:-1]) < 60
    assert rows["node02"][:6] == ["node02", "lost", "-", "0", "never", "0"]
    assert "nvidia-smi: not found" in next(line for line in lines if line.startswith("node02"))


def test_nodes_json(ctl_env, cluster):
    nodes = json.loads(run("nodes", "-o", "json", env=ctl_env).stdout)
    assert [n["name"] for n in nodes] == ["node01", "node02"]
    assert nodes[0]["fabrics"] == ["ib-a", "ib-b"]
    assert [g["index"] for g in nodes[0]["gpus"]] == [0, 1]
    assert nodes[1]["status"] == "lost" and nodes[1]["discovery_errors"] == ["nvidia-smi: not found"]


def test_cordon_uncordon_and_refusals(ctl_env, cluster):
    assert run("cordon", "node01", env=ctl_env).stdout.strip() == "node01 is cordoned"
    assert Node.objects.get(name="node01").status == NodeStatus.CORDONED

    again = run("cordon", "node01", env=ctl_env, rc=1)
    assert again.stderr.strip() == "llmgw: 409: node node01 is cordoned; it cannot become cordoned"

    assert run("uncordon", "node01", env=ctl_env).stdout.strip() == "node01 is ready"
    assert Node.objects.get(name="node01").status == NodeStatus.READY

    lost = run("cordon", "node02", env=ctl_env, rc=1)
    assert "409" in lost.stderr and "node node02 is lost" in lost.stderr

    unknown = run("cordon", "node99", env=ctl_env, rc=1)
    assert unknown.stderr.strip() == "llmgw: 404: no node named 'node99'; 'llmgw ctl nodes' lists them"

    odd = run("cordon", "no/de?x", env=ctl_env, rc=1)
    assert "404" in odd.stderr


def test_events(ctl_env, cluster):
    node01, _ = cluster
    EventFactory(node=node01, subject="node/node01", kind=NodeEventKind.NODE_STATUS, message="ready -> cordoned")
    EventFactory(subject="control-plane", kind=CoreEventKind.CONTROL_PLANE, message="hearing nodes again",
                 severity="warning")
    lines = run("events", env=ctl_env).stdout.splitlines()
    assert lines[0].split() == ["time", "severity", "subject", "message"]
    assert "hearing nodes again" in lines[1] and "warning" in lines[1]  # newest first
    assert "ready -> cordoned" in lines[2]

    only = json.loads(run("events", "--node", "node01", "-o", "json", env=ctl_env).stdout)
    assert [e["message"] for e in only] == ["ready -> cordoned"]
    assert len(json.loads(run("events", "--limit", "1", "-o", "json", env=ctl_env).stdout)) == 1


def test_cordon_shows_up_in_events(ctl_env, cluster):
    run("cordon", "node01", env=ctl_env)
    events = json.loads(run("events", "--node", "node01", "-o", "json", env=ctl_env).stdout)
    assert events[0]["message"] == "ready -> cordoned: cordoned by user admin"  # the token's user
    assert Event.objects.filter(node__name="node01", kind=NodeEventKind.NODE_STATUS).count() == 1


def test_unreachable_control_plane(tmp_path, db):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = server_env(LLMGW_URL=url, LLMGW_TOKEN="whatever")
    for args in (["nodes"], ["nodes", "-o", "json"], ["cordon", "node01"], ["events"]):
        proc = run(*args, env=env, rc=1)
        assert proc.stderr.startswith(f"llmgw: cannot reach the control plane at {url}"), proc.stderr
        assert "LLMGW_URL" in proc.stderr
        assert proc.stdout == ""


def test_bad_token(ctl_env):
    env = dict(ctl_env, LLMGW_TOKEN="not-a-token")
    proc = run("nodes", env=env, rc=1)
    assert proc.stderr.startswith("llmgw: 401: Invalid token.")
    assert "LLMGW_TOKEN" in proc.stderr


def test_no_token_says_where_to_get_one(web, tmp_path):
    env = server_env(LLMGW_URL=web.url, LLMGW_DATA_DIR=str(tmp_path / "data"))
    env.pop("LLMGW_TOKEN", None)
    proc = run("nodes", env=env, rc=1)
    assert "no API token: set LLMGW_TOKEN" in proc.stderr


def test_token_from_the_data_directory(web, admin_token, tmp_path, cluster):
    data = tmp_path / "data"
    data.mkdir()
    (data / "ctl-token").write_text(admin_token + "\n")
    env = server_env(LLMGW_URL=web.url, LLMGW_DATA_DIR=str(data))
    env.pop("LLMGW_TOKEN", None)
    assert [n["name"] for n in json.loads(run("nodes", "-o", "json", env=env).stdout)] == ["node01", "node02"]


def test_url_that_is_not_llmgw(tmp_path, db):
    """A web server that is not llmgw answers HTML: a message, not a traceback."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html>hello</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = server_env(LLMGW_URL=f"http://127.0.0.1:{server.server_port}", LLMGW_TOKEN="x")
        proc = run("nodes", env=env, rc=1)
        assert "did not answer with JSON" in proc.stderr
    finally:
        server.shutdown()
        server.server_close()
