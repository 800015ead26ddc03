"""Onboarding through a real OpenSSH sshd on a loopback address: the node is
a directory tree; its agent really starts, really heartbeats over mTLS to the
agent API under test, and the job ends on that first heartbeat. The job is
advanced in this process as a worker would (tests/provisioning/test_onboard_e2e.py
runs it through the web process, a Celery worker and ``llmgw ctl``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from django.conf import settings
from rest_framework.test import APIClient

from agent.simkit import KitFabric
from nodes.models import Node
from pki.models import Certificate
from provisioning import sshkeys
from provisioning.onboard import enroll
from provisioning.choices import JobKind, JobStatus
from provisioning.models import Job
from provisioning.onboard.request import job_onboard_create
from provisioning.validation import RequestInvalid
from tests.conftest import free_port, mtls_client

from .conftest import job_run
from .sshnode import TEST_USER, SshNode, node_root

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]


@pytest.fixture
def quick(settings):
    settings.LLMGW_PROVISION_POLL_MIN = 0.2
    settings.LLMGW_PROVISION_POLL_MAX = 1.0
    settings.LLMGW_PROVISION_UNREACHABLE_DEADLINE = 2.0
    settings.LLMGW_ONBOARD_HEARTBEAT_DEADLINE = 60.0
    return settings


@pytest.fixture
def ssh_nodes():
    """make(node_id, last_octet, **kw) -> a started SshNode; all stopped after the test."""
    made: list[SshNode] = []

    def make(node_id: str, octet: int, **kwargs) -> SshNode:
        host = f"127.0.1.{octet}"
        kwargs.setdefault("fabrics", [KitFabric("ib-a", ("mlx5_0", "mlx5_1"))])
        node = SshNode(node_id, host, free_port(host), node_root(f"llmgw-{node_id}-"),
                       [sshkeys.control_plane_public_key()], **kwargs)
        made.append(node)
        return node.start()

    yield make
    for node in made:
        node.remove()


def request_for(node: SshNode, agent_api, **overrides) -> dict:
    request = dict(
        node=node.node_id, addr=node.host, ssh_port=node.port, ssh_user="root",
        fabrics=["ib-a:mlx5_0,mlx5_1"], mgmt_interface="lo", nvidia_smi=str(node.nvidia_smi),
        ib_root=str(node.ib_root), agent_server=agent_api.url, root=str(node.root),
        host_key_fingerprint=sshkeys.fingerprint(node.host_key),
    )
    request.update(overrides)
    return request


def admin_client() -> APIClient:
    from django.contrib.auth import get_user_model

    client = APIClient()
    client.force_authenticate(get_user_model().objects.create_superuser("ops", "", "pw-for-tests"))
    return client


def node_key(node: SshNode) -> bytes:
    return (node.root / f"etc/llmgw/{node.node_id}-key.pem").read_bytes()


def key_body(pem: bytes) -> bytes:
    """The base64 body of the key: what any copy of it would contain."""
    return b"".join(line for line in pem.splitlines() if not line.startswith(b"-----"))


def test_onboard_from_rest_ends_on_first_heartbeat_and_the_key_stays_on_the_node(
        quick, agent_api, ssh_nodes, tmp_path):
    node = ssh_nodes("onb-rest", 201)
    client = admin_client()
    answer = client.post("/api/v1/jobs/onboard/", request_for(node, agent_api), format="json")
    assert answer.status_code == 201, answer.content
    job = job_run(answer.json()["id"], timeout=120)
    assert job.status == JobStatus.SUCCEEDED, (job.status_reason, node.agent_log())

    row = Node.objects.get(name="onb-rest")
    assert row.gpus.count() == 4
    assert sorted(row.hcas.values_list("name", "fabric__name")) == [("mlx5_0", "ib-a"), ("mlx5_1", "ib-a")]
    heartbeat = job.steps.get(name="heartbeat")
    assert heartbeat.data["inventory"]["fabrics"] == ["ib-a"]
    assert "4 GPU(s) NVIDIA H200" in heartbeat.log[-1]["line"]
    assert node.agent_pid() is not None, "the agent runs on the node"
    # Engines run as the engines' user (nobody here: see conftest), and the
    # unit's command line is quoted words.
    assert yaml.safe_load((node.root / "etc/llmgw/agent.yaml").read_text())["engine_user"] == "nobody"
    unit = (node.root / "etc/systemd/system/llmgw-agent.service").read_text()
    assert f'ExecStart="{node.root}/opt/llmgw-agent/venv/bin/llmgw-agent" "run" "--config"' in unit

    key_path = node.root / "etc/llmgw/onb-rest-key.pem"
    assert key_path.stat().st_mode & 0o777 == 0o600 and key_path.stat().st_uid == 0
    assert (node.root / "usr/local/share/ca-certificates/llmgw-ca.crt").exists()
    assert (node.root / "run/update-ca-certificates.ran").exists()
    [cert] = Certificate.objects.filter(common_name="onb-rest")
    assert cert.pem.strip() == (node.root / "etc/llmgw/onb-rest.pem").read_text().strip()

    # The private key is nowhere but on the node: not in the control plane's
    # data and PKI directories, its database, its logs, or the job.
    secret = key_body(node_key(node))
    for directory in (Path(settings.DATA_DIR), Path(settings.PKI_DIR)):
        for path in directory.rglob("*"):
            if path.is_file():
                assert secret not in key_body(path.read_bytes()), path
    db = settings.DATABASES["default"]
    dump = subprocess.run(["pg_dump", "--data-only", "-h", db["HOST"], "-p", str(db["PORT"]), "-U", db["USER"],
                           db["NAME"]], capture_output=True, check=True).stdout
    assert b"onb-rest" in dump and secret not in key_body(dump)
    assert secret not in key_body(agent_api.log().encode())

    # A node that heartbeats is not onboarded again by mistake.
    again = client.post("/api/v1/jobs/onboard/", request_for(node, agent_api), format="json")
    assert again.status_code == 400 and "reinstall" in again.json()["node"][0]


def test_a_host_key_other_than_the_pin_is_refused_and_nothing_is_written(quick, agent_api, ssh_nodes, tmp_path):
    node = ssh_nodes("onb-mitm", 202)
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    # Pinned when llmgw made the machine: another key than the one it presents now.
    Job.objects.create(kind=JobKind.PROVISION, node_name="onb-mitm", status=JobStatus.SUCCEEDED,
                       status_changed_at="2026-01-01T00:00:00Z",
                       ssh_host_key=" ".join(other.with_suffix(".pub").read_text().split()[:2]))
    job = job_onboard_create(request=request_for(node, agent_api, host_key_fingerprint=""))
    job = job_run(job.pk)
    assert job.status == JobStatus.FAILED
    assert "presented host key" in job.status_reason and "not the pinned" in job.status_reason
    assert sshkeys.fingerprint(node.host_key) in job.status_reason
    assert not (node.root / "etc").exists() and not (node.root / "opt").exists()
    assert not Certificate.objects.filter(common_name="onb-mitm").exists()


def test_preflight_names_a_missing_nvidia_smi_and_a_missing_hca(quick, agent_api, ssh_nodes):
    node = ssh_nodes("onb-bare", 203, with_nvidia_smi=False)
    job = job_onboard_create(request=request_for(node, agent_api, fabrics=["ib-a:mlx5_0,mlx5_1", "ib-b:mlx5_7"]))
    job = job_run(job.pk)
    assert job.status == JobStatus.FAILED
    assert job.steps.get(name="preflight").status == "failed"
    assert "nvidia-smi" in job.status_reason and "is not there" in job.status_reason
    assert "HCA mlx5_7 (fabric ib-b)" in job.status_reason
    assert "mlx5_0" not in job.status_reason
    assert not (node.root / "opt").exists()


def test_an_hca_under_two_fabrics_is_refused_before_install(quick, agent_api, ssh_nodes):
    node = ssh_nodes("onb-twice", 204)
    job = job_onboard_create(request=request_for(node, agent_api, fabrics=["ib-a:mlx5_0,mlx5_1", "ib-b:mlx5_1"]))
    job = job_run(job.pk)
    assert job.status == JobStatus.FAILED
    assert "HCA mlx5_1 is under two fabrics (ib-a and ib-b)" in job.status_reason
    assert not (node.root / "opt").exists() and not (node.root / "etc").exists()


def test_sudo_that_asks_for_a_password_is_named(quick, agent_api, ssh_nodes):
    node = ssh_nodes("onb-nosudo", 205)
    job = job_onboard_create(request=request_for(node, agent_api, ssh_user=TEST_USER))
    job = job_run(job.pk)
    assert job.status == JobStatus.FAILED, job.status_reason
    assert f"sudo -n does not work for {TEST_USER}" in job.status_reason
    assert not (node.root / "opt").exists()


class WorkerKilled(BaseException):
    """Stands for the worker dying: not an Exception, so no step catches it."""


def test_a_job_killed_after_signing_resumes_with_the_nodes_key_and_signs_nothing_twice(
        quick, agent_api, ssh_nodes, monkeypatch):
    node = ssh_nodes("onb-killed", 206)
    real_sign = enroll.cert_sign_node

    def sign_then_die(**kwargs):
        real_sign(**kwargs)
        raise WorkerKilled()

    monkeypatch.setattr(enroll, "cert_sign_node", sign_then_die)
    job = job_onboard_create(request=request_for(node, agent_api))
    with pytest.raises(WorkerKilled):
        job_run(job.pk)
    assert job.steps.get(name="certificate").status == "running"
    assert Certificate.objects.filter(common_name="onb-killed").count() == 1
    key_before = node_key(node)
    assert not (node.root / "etc/llmgw/onb-killed.pem").exists(), "killed before the certificate was copied"

    monkeypatch.setattr(enroll, "cert_sign_node", real_sign)
    job = job_run(job.pk, timeout=120)
    assert job.status == JobStatus.SUCCEEDED, (job.status_reason, node.agent_log())
    assert node_key(node) == key_before
    [cert] = Certificate.objects.filter(common_name="onb-killed")
    assert cert.pem.strip() == (node.root / "etc/llmgw/onb-killed.pem").read_text().strip()
    assert "signed earlier for this key" in " ".join(l["line"] for l in job.steps.get(name="certificate").log)


def test_bad_requests_are_refused_by_field(quick, agent_api):
    with pytest.raises(RequestInvalid) as refused:
        job_onboard_create(request=dict(node="Bad_Name", addr="no such host!", fabrics=["ib-a:"],
                                        host_key_fingerprint="MD5:aa", root="relative"))
    assert set(refused.value.errors) == {"node", "addr", "fabrics", "host_key_fingerprint", "root"}
    assert not Job.objects.exists()


def test_reinstall_upgrades_in_place_then_a_wiped_machine_gets_a_new_identity(quick, agent_api, ssh_nodes, tmp_path):
    node = ssh_nodes("onb-again", 209)
    client = admin_client()
    assert client.post("/api/v1/jobs/onboard/", request_for(node, agent_api), format="json").status_code == 201
    first = job_run(Job.objects.get(node_name="onb-again").pk, timeout=120)
    assert first.status == JobStatus.SUCCEEDED, (first.status_reason, node.agent_log())
    [cert] = Certificate.objects.filter(common_name="onb-again")
    agent_before = node.agent_pid()
    installed = (node.root / "opt/llmgw-agent/venv").readlink()

    # Reinstalling a healthy node: the same build and key stay, the agent is restarted.
    answer = client.post("/api/v1/jobs/onboard/", request_for(node, agent_api, reinstall=True), format="json")
    assert answer.status_code == 201, answer.content
    job = job_run(answer.json()["id"], timeout=120)
    assert job.status == JobStatus.SUCCEEDED, (job.status_reason, node.agent_log())
    assert {s.name: s.status for s in job.steps.all()}["agent"] == "skipped"
    assert (node.root / "opt/llmgw-agent/venv").readlink() == installed
    assert list(Certificate.objects.filter(common_name="onb-again")) == [cert]
    assert node.agent_pid() not in (None, agent_before), "the unit was restarted"

    # The machine is reinstalled (its disk wiped, the agent gone): a new key on
    # the node, a new certificate, and the old one refused from then on.
    old_cert, old_key = tmp_path / "old.pem", tmp_path / "old-key.pem"
    old_cert.write_bytes((node.root / "etc/llmgw/onb-again.pem").read_bytes())
    old_key.write_bytes(node_key(node))
    ca = tmp_path / "ca.pem"
    ca.write_bytes((node.root / "etc/llmgw/ca.pem").read_bytes())
    os.kill(node.agent_pid(), signal.SIGKILL)
    for wiped in ("etc/llmgw", "opt/llmgw-agent", "var/lib/llmgw-agent"):
        shutil.rmtree(node.root / wiped, ignore_errors=True)
    answer = client.post("/api/v1/jobs/onboard/", request_for(node, agent_api, reinstall=True), format="json")
    job = job_run(answer.json()["id"], timeout=120)
    assert job.status == JobStatus.SUCCEEDED, (job.status_reason, node.agent_log())
    assert node_key(node) != old_key.read_bytes()
    old = Certificate.objects.get(pk=cert.pk)
    [new] = Certificate.objects.filter(common_name="onb-again", revoked_at=None)
    assert old.revocation_reason == f"superseded by {new.serial} (onboarding job {job.pk})"
    assert "superseded" in job.steps.get(name="certificate").log[-1]["line"]
    from core.models import Event
    revoked = Event.objects.get(subject=f"certificate/{cert.serial}")
    assert revoked.node.name == "onb-again" and "revoked by user ops: superseded by" in revoked.message
    # Refused: a 403 naming the revocation, or (once the listener's copy of
    # the revoked serials is fresh) the connection closed after the handshake.
    with mtls_client(str(old_cert), str(old_key), str(ca), timeout=10) as mtls:
        try:
            refused = mtls.post(f"{agent_api.url}/agent/v1/nodes/onb-again/heartbeat", json={})
        except httpx.TransportError:
            assert "revoked certificate cn=onb-again serial=" + cert.serial in agent_api.log()
        else:
            assert refused.status_code == 403 and "revoked" in refused.json()["error"]
