"""Fixtures of the provisioning tests: a Proxmox (fakepve over real HTTPS, its
own certificate trusted as the CA), an SSH server where the new VM's address
points (loopback), a hypervisor row, and a driver that runs a job's advances
in this process."""

from __future__ import annotations

import time

import pytest
from django.utils import timezone

from tests.conftest import free_port

from .pve import IMAGE, TOKEN_ID, TOKEN_SECRET, Loop, pve_make, ssh_server

VM_HOST = "127.0.77.1"


@pytest.fixture(autouse=True)
def _engine_user(engine_user_that_exists):
    """Onboarding here creates no user on this host (tests/conftest.py)."""


@pytest.fixture(scope="session")
def servers_loop():
    loop = Loop()
    yield loop
    loop.stop()


@pytest.fixture
def pve(servers_loop, tmp_path):
    server, _cert = pve_make(tmp_path)
    servers_loop.call(server.start(server.certfile, server.keyfile))
    yield server
    server.flaky_network()
    if server.resize_gate is not None:
        servers_loop.loop.call_soon_threadsafe(server.resize_gate.set)
    servers_loop.call(server.stop())


@pytest.fixture
def ssh_port():
    return free_port(VM_HOST)


@pytest.fixture
def vm_ssh(servers_loop, ssh_port, settings):
    """What answers on the new VM's address: (host, port, its host key line)."""
    settings.LLMGW_PROVISION_SSH_PORT = ssh_port
    server, host_key = servers_loop.call(ssh_server(VM_HOST, ssh_port))
    yield VM_HOST, ssh_port, host_key
    server.close()


@pytest.fixture
def fast(settings):
    settings.LLMGW_PROVISION_POLL_MIN = 0.05
    settings.LLMGW_PROVISION_POLL_MAX = 0.2
    settings.LLMGW_PROVISION_SSH_DEADLINE = 5.0
    return settings


def hypervisor_fields(pve, **overrides) -> dict:
    fields = dict(
        name="pve", url=pve.url, token_id=TOKEN_ID, token_secret=TOKEN_SECRET,
        ca_pem=open(pve.certfile).read(), node="pve1", storage="local-lvm", image=IMAGE, bridge="vmbr0",
    )
    fields.update(overrides)
    return fields


@pytest.fixture
def hypervisor(pve):
    from provisioning import services

    return services.hypervisor_create(actor="tests", **hypervisor_fields(pve))


def provision_request(**overrides) -> dict:
    request = dict(node="llmgw-node04", hypervisor="pve", vmid=144, ip=f"{VM_HOST}/24", gateway="127.0.77.254",
                   cores=4, memory=8192, disk="200G", nameserver="127.0.77.254")
    request.update(overrides)
    return request


def job_run(job_id: int, timeout: float = 30.0):
    """Advance the job in this process until it ends, as a worker would: the
    waits a step asks for are honoured, not skipped."""
    from provisioning import runner
    from provisioning.choices import TERMINAL
    from provisioning.models import Job

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = Job.objects.get(pk=job_id)
        if job.status in TERMINAL:
            return job
        if job.next_run_at and job.next_run_at > timezone.now():
            time.sleep(min((job.next_run_at - timezone.now()).total_seconds(), 0.5))
        runner.job_advance(job_id=job_id)
    raise AssertionError(f"job {job_id} did not end within {timeout}s")


def creates(pve) -> list:
    return [r for r in pve.requests if r[0] == "POST" and r[1].endswith("/nodes/pve1/qemu")]
