"""Provisioning with real processes: the web process (REST API), a Celery
worker, ``llmgw ctl`` as an operator runs it; the test's Proxmox and the new
VM's SSH server on loopback addresses."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import pytest
from django.conf import settings

from core.models import Event
from provisioning import services
from provisioning.choices import TERMINAL, JobStatus
from provisioning.models import Job, Step
from tests.conftest import REPO, server_env
from tests.control_plane import celery_factory, redis_url  # noqa: F401 - fixture

from .conftest import creates, hypervisor_fields, provision_request
from .pve import TOKEN_SECRET

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

LLMGW = str(REPO / ".venv" / "bin" / "llmgw")


@pytest.fixture
def plane(pki_dir, web_factory, celery_factory, admin_token, vm_ssh, settings, tmp_path):  # noqa: F811
    """Web and worker processes sharing the test's database, Redis and PKI."""
    _host, ssh_port, _key = vm_ssh
    settings.LLMGW_PROVISION_STALL_GRACE = 1.0
    env = {
        "LLMGW_PROVISION_SSH_PORT": str(ssh_port),
        "LLMGW_PROVISION_POLL_MIN": "0.1",
        "LLMGW_PROVISION_POLL_MAX": "0.5",
        "LLMGW_PROVISION_LEASE": "3",
        "CELERY_BROKER_URL": redis_url(),
        "LLMGW_REDIS_URL": redis_url(),
    }
    web = web_factory(**env)

    class Plane:
        url = web.url
        token = admin_token
        workers = []

        def worker(self):
            proc = celery_factory("worker", **env)
            proc.wait_ready()
            self.workers.append(proc)
            return proc

        def ctl_env(self):
            return server_env(LLMGW_URL=web.url, LLMGW_TOKEN=admin_token, LLMGW_DATA_DIR=str(tmp_path / "ctl"))

        def logs(self):
            return web.log() + "".join(w.log() for w in self.workers)

    return Plane()


@pytest.fixture
def hypervisor_row(plane, pve):
    return services.hypervisor_create(actor="tests", **hypervisor_fields(pve))


def ctl(*args: str, env: dict, rc: int = 0, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([LLMGW, "ctl", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == rc, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _wait_job(job_id: int, timeout: float = 60) -> Job:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = Job.objects.get(pk=job_id)
        if job.status in TERMINAL:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {job.status} after {timeout}s")


def _no_secret_anywhere(plane, *texts: str) -> None:
    stored = json.dumps([list(Job.objects.values()), list(Step.objects.values()), list(Event.objects.values())],
                        default=str)
    for text in (plane.logs(), stored, *texts):
        assert TOKEN_SECRET not in text


def test_rest_api_happy_path_with_a_worker(plane, pve, hypervisor_row, vm_ssh):
    plane.worker()
    headers = {"Authorization": f"Token {plane.token}"}
    with httpx.Client(base_url=plane.url, headers=headers, timeout=30) as client:
        answer = client.post("/api/v1/jobs/provision/", json=provision_request())
        assert answer.status_code == 201, answer.text
        job = _wait_job(answer.json()["id"])
        detail = client.get(f"/api/v1/jobs/{job.pk}/").json()
        listing = client.get("/api/v1/hypervisors/").text
    assert job.status == JobStatus.SUCCEEDED, job.status_reason
    assert detail["ssh_host_key"] == vm_ssh[2]
    assert pve.vm(144).status == "running" and len(creates(pve)) == 1
    _no_secret_anywhere(plane, json.dumps(detail), listing, answer.text)


def test_ctl_provision_wait_shows_the_steps(plane, pve, vm_ssh, tmp_path):
    # Every Proxmox task takes a second: the worker polls by re-scheduling.
    pve.time_scale, pve.task_secs = 1.0, 1.0
    plane.worker()
    env = plane.ctl_env()
    secret_file = tmp_path / "secret"
    secret_file.write_text(TOKEN_SECRET + "\n")
    ca_file = tmp_path / "ca.pem"
    ca_file.write_text(open(pve.certfile).read())
    added = ctl("hypervisors", "add", "pve", "--url", pve.url, "--token-id", "llmgw@pve!prov",
                "--token-secret-file", str(secret_file), "--ca-file", str(ca_file), "--node", "pve1",
                "--image", "local:import/noble.qcow2", env=env)
    check = ctl("hypervisors", "check", "pve", env=env)
    assert "the token holds every privilege a provisioning job needs" in check.stdout

    run = ctl("provision", "--name", "llmgw-node04", "--vmid", "144", "--ip", "127.0.77.1/24",
              "--gateway", "127.0.77.254", "--cores", "4", "--memory", "8192", "--wait", env=env)
    out = run.stdout
    for title in ("Validate the request", "Check that the VMID is free", "Create the VM", "Resize its disk",
                  "Start it", "Wait for SSH and pin its host key"):
        assert f"{title}: done" in out, out
    assert "      VMID 144 is free" in out and "creating VM 144 on pve1: task UPID:pve1:" in out
    assert " succeeded; host key SHA256:" in out.strip().splitlines()[-1]

    listing = json.loads(ctl("jobs", "-o", "json", env=env).stdout)
    assert [j["status"] for j in listing] == ["succeeded"]
    shown = ctl("jobs", "show", str(listing[0]["id"]), env=env).stdout
    assert "Create the VM: done" in shown and "host key: SHA256:" in shown
    assert ctl("ssh-key", env=env).stdout.startswith("ssh-ed25519 ")

    # A taken VMID: refused, with the reason, and a non-zero exit.
    failed = ctl("provision", "llmgw-node05", "--vmid", "144", "--ip", "127.0.77.2/24", "--gateway",
                 "127.0.77.254", "--wait", env=env, rc=1)
    assert "VMID 144 is already taken (llmgw-node04); nothing was created" in failed.stderr
    assert len(creates(pve)) == 1

    # Bad input: the field named, nothing queued.
    bad = ctl("provision", "n6", "--vmid", "146", "--ip", "127.0.77.3", "--gateway", "127.0.77.254", env=env, rc=1)
    assert "400" in bad.stderr and "ip" in bad.stderr
    denied = ctl("jobs", env=server_env(LLMGW_URL=plane.url, LLMGW_TOKEN="nope"), rc=1)
    assert "401" in denied.stderr
    _no_secret_anywhere(plane, added.stdout, added.stderr, check.stdout, out, shown, failed.stderr)


def test_ctl_provision_without_the_permission_is_refused(plane, pve, hypervisor_row):
    from django.contrib.auth import get_user_model
    from accounts.services import token_create

    user = get_user_model().objects.create_user("nodeop", password="x", is_staff=True)
    env = server_env(LLMGW_URL=plane.url, LLMGW_TOKEN=token_create(user=user).token)
    refused = ctl("provision", "n1", "--vmid", "150", "--ip", "127.0.77.5/24", "--gateway", "127.0.77.254",
                  env=env, rc=1)
    assert "403" in refused.stderr and "provisioning.run_provisioning" in refused.stderr
    assert Job.objects.count() == 0


def test_a_worker_killed_after_the_create_resumes_the_same_vm(plane, pve, hypervisor_row, servers_loop):
    async def gate():
        return asyncio.Event()

    pve.resize_gate = servers_loop.call(gate())
    first = plane.worker()
    job = services.job_provision_create(request=provision_request())
    assert pve.resize_seen.wait(60), first.log()
    # The worker is inside the resize call: after the create, before the start.
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait(10)
    assert len(creates(pve)) == 1 and pve.vm(144).status == "stopped"
    assert Job.objects.get(pk=job.pk).status == JobStatus.RUNNING
    servers_loop.loop.call_soon_threadsafe(pve.resize_gate.set)
    pve.resize_gate = None

    plane.worker()
    deadline = time.monotonic() + 30
    while not services.jobs_resume_stalled():
        assert time.monotonic() < deadline, "the killed worker's lease never expired"
        time.sleep(0.5)
    job = _wait_job(job.pk)
    assert job.status == JobStatus.SUCCEEDED, job.status_reason
    assert len(creates(pve)) == 1
    assert [vm.vmid for vm in pve.vms] == [144] and pve.vm(144).status == "running"
    steps = {s.name: s.status for s in job.steps.all()}
    assert steps["create"] == "done" and steps["start"] == "done"
