"""Onboarding with real processes: ``llmgw ctl`` as an operator runs it, the web
process (REST API), a Celery worker, the agent API; the machine is a real
sshd on a loopback address and the agent a real process on it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from django.conf import settings

from agent.simkit import KitFabric
from nodes.models import Node
from provisioning import services, sshkeys
from provisioning.choices import JobStatus
from provisioning.models import Job
from tests.conftest import REPO, free_port, server_env
from tests.control_plane import celery_factory, redis_url  # noqa: F401 - fixture

from .conftest import VM_HOST, hypervisor_fields
from .sshnode import SshNode, node_root

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

LLMGW = str(REPO / ".venv" / "bin" / "llmgw")


def worker_public_key(settings_) -> str:
    """The control plane's SSH key as the worker process will find it (its data dir)."""
    data_dir = Path(server_env()["LLMGW_DATA_DIR"])
    saved = settings_.DATA_DIR
    settings_.DATA_DIR = data_dir
    try:
        return sshkeys.control_plane_public_key()
    finally:
        settings_.DATA_DIR = saved


@pytest.fixture
def plane(pki_dir, web_factory, celery_factory, agent_api_factory, admin_token, settings, tmp_path):  # noqa: F811
    agent_api = agent_api_factory()
    ssh_port = free_port(VM_HOST)
    env = {
        "LLMGW_PROVISION_SSH_PORT": str(ssh_port),
        "LLMGW_PROVISION_POLL_MIN": "0.2",
        "LLMGW_PROVISION_POLL_MAX": "1",
        "LLMGW_AGENT_SERVER": agent_api.url,
        "CELERY_BROKER_URL": redis_url(),
        "LLMGW_REDIS_URL": redis_url(),
    }
    web = web_factory(**env)
    worker = celery_factory("worker", **env)
    worker.wait_ready()

    class Plane:
        url = web.url
        port = ssh_port
        key = worker_public_key(settings)

        def ctl(self, *args: str, rc: int = 0) -> subprocess.CompletedProcess:
            env = server_env(LLMGW_URL=web.url, LLMGW_TOKEN=admin_token, LLMGW_DATA_DIR=str(tmp_path / "ctl"))
            proc = subprocess.run([LLMGW, "ctl", *args], env=env, cwd=REPO, capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == rc, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}\n{worker.log()}"
            assert "Traceback" not in proc.stderr, proc.stderr
            return proc

    return Plane()


@pytest.fixture
def machine(plane):
    made = []

    def make(node_id: str, host: str, port: int) -> SshNode:
        node = SshNode(node_id, host, port, node_root(f"llmgw-{node_id}-"), [plane.key],
                       fabrics=[KitFabric("ib-a", ("mlx5_0", "mlx5_1"))])
        made.append(node)
        return node.start()

    yield make
    for node in made:
        node.remove()


def test_ctl_onboard_wait_with_a_confirmed_fingerprint(plane, machine):
    node = machine("onb-ctl", "127.0.1.211", free_port("127.0.1.211"))
    run = plane.ctl(
        "onboard", "--node", "onb-ctl", "--addr", node.host, "--ssh-port", str(node.port),
        "--host-key-fingerprint", sshkeys.fingerprint(node.host_key), "--fabric", "ib-a",
        "--mgmt-interface", "lo", "--nvidia-smi", str(node.nvidia_smi), "--ib-root", str(node.ib_root),
        "--root", str(node.root), "--wait")
    out = run.stdout
    for title in ("Connect over SSH (pinned host key)", "Preflight checks", "Install the agent from the uploaded wheels",
                  "Key on the node, certificate signed, root trusted", "Write agent.yaml and check it",
                  "Install the unit; systemctl enable --now", "Wait for the first heartbeat"):
        assert f"{title}: done" in out, out
    assert "onb-ctl heartbeats" in out and "mlx5_0 (ib-a), mlx5_1 (ib-a)" in out
    assert Node.objects.get(name="onb-ctl").gpus.count() == 4
    assert node.agent_pid() is not None

    refused = plane.ctl("onboard", "onb-ctl", "--addr", node.host, rc=1)
    assert "onboard it again only with reinstall" in refused.stderr


def test_ctl_provision_then_onboard_over_the_host_key_it_pinned(plane, machine, pve, tmp_path):
    services.hypervisor_create(actor="tests", **hypervisor_fields(pve))
    node = machine("llmgw-node05", VM_HOST, plane.port)
    run = plane.ctl(
        "provision", "--name", "llmgw-node05", "--vmid", "145", "--ip", f"{VM_HOST}/24", "--gateway",
        "127.0.77.254", "--cores", "4", "--memory", "8192", "--onboard", "--ssh-user", "root",
        "--fabric", "ib-a", "--mgmt-interface", "lo", "--nvidia-smi", str(node.nvidia_smi),
        "--ib-root", str(node.ib_root), "--root", str(node.root), "--wait")
    assert "Wait for SSH and pin its host key: done" in run.stdout
    assert "Connect over SSH (pinned host key): done" in run.stdout and "llmgw-node05 heartbeats" in run.stdout
    jobs = list(Job.objects.filter(node_name="llmgw-node05").order_by("pk"))
    assert [(j.kind, j.status) for j in jobs] == [("provision", JobStatus.SUCCEEDED), ("onboard", JobStatus.SUCCEEDED)]
    # No fingerprint was given: the onboarding trusted exactly the key provisioning pinned.
    assert jobs[1].params["host_key_fingerprint"] == "" and jobs[1].ssh_host_key == jobs[0].ssh_host_key
