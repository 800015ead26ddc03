"""Provisioning jobs against the test's Proxmox, run by the step runner in
this process (the real-worker cases are in test_e2e.py)."""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import unquote

import pytest
from django.db import connection

from provisioning import runner, services, sshkeys
from provisioning.choices import JobStatus, StepStatus
from provisioning.models import Job

from .conftest import VM_HOST, creates, job_run, provision_request

pytestmark = pytest.mark.django_db(transaction=True)


def _steps(job: Job) -> dict[str, str]:
    return {s.name: s.status for s in job.steps.order_by("index")}


def _log(job: Job) -> str:
    return "\n".join(line["line"] for s in job.steps.order_by("index") for line in s.log)


def test_happy_path_makes_the_vm_and_pins_its_host_key(pve, hypervisor, vm_ssh, fast):
    _host, _port, host_key = vm_ssh
    job = services.job_provision_create(request=provision_request())
    job = job_run(job.pk)
    assert job.status == JobStatus.SUCCEEDED, job.status_reason
    assert _steps(job) == {n: StepStatus.DONE for n in ("validate", "vmid", "create", "resize", "start", "ssh")}

    vm = pve.vm(144)
    assert vm.name == "llmgw-node04" and vm.status == "running"
    config = vm.config
    assert config["cores"] in (4, "4") and str(config["memory"]) == "8192"
    assert config["scsihw"] == "virtio-scsi-pci" and config["boot"] == "order=scsi0"
    assert config["scsi0"].startswith("local-lvm:vm-144-disk-") and "size=200G" in config["scsi0"]
    assert config["ide2"].startswith("local-lvm:vm-144-disk-") and "media=cdrom" in config["ide2"]
    assert config["serial0"] == "socket" and config["vga"] == "serial0" and str(config["agent"]) == "1"
    assert config["net0"].startswith("virtio=") and "bridge=vmbr0" in config["net0"]
    assert config["ipconfig0"] == f"ip={VM_HOST}/24,gw=127.0.77.254"
    assert config["nameserver"] == "127.0.77.254" and config["ciuser"] == "ubuntu"
    assert str(config["ciupgrade"]) == "0" and config["tags"] == "llmgw"
    assert job.marker in config["description"] and f"job {job.pk}" in config["description"]
    keys = unquote(config["sshkeys"])
    assert sshkeys.control_plane_public_key() in keys
    # The create asked for the image volume (an API token cannot use a path).
    assert b"import-from%3Dlocal%3Aimport%2Fnoble.qcow2" in creates(pve)[0][2]
    assert len(creates(pve)) == 1

    assert job.ssh_host_key == host_key
    from provisioning.selectors import node_host_key

    assert node_host_key(node_name="llmgw-node04") == host_key


def test_taken_vmid_is_refused_and_nothing_is_created(pve, hypervisor, fast):
    pve.add_vm(144, "someone-elses-vm", node="pve1")
    job = job_run(services.job_provision_create(request=provision_request()).pk)
    assert job.status == JobStatus.FAILED
    assert "VMID 144 is already taken (someone-elses-vm)" in job.status_reason
    assert _steps(job)["vmid"] == StepStatus.FAILED and _steps(job)["create"] == StepStatus.PENDING
    assert creates(pve) == []
    assert pve.vm(144).name == "someone-elses-vm"


def test_taken_vmid_hidden_from_the_token_is_still_refused(pve, hypervisor, fast):
    """/cluster/resources would hide it; /cluster/nextid does not."""
    pve.add_vm(144, "hidden", node="pve2")
    job = job_run(services.job_provision_create(request=provision_request()).pk)
    assert job.status == JobStatus.FAILED and "VMID 144 is already taken" in job.status_reason
    assert creates(pve) == []


def test_two_jobs_for_one_vmid_make_one_vm(pve, hypervisor, vm_ssh, fast, servers_loop):
    """Both pass the nextid check; the create is the guard: one wins, the other is refused."""
    first = services.job_provision_create(request=provision_request(node="node-a"))
    second = services.job_provision_create(request=provision_request(node="node-b"))
    for job in (first, second):
        # validate and vmid, for both, before either creates.
        runner._advance_one(job_id=job.pk, owner="")
    Job.objects.update(lease_owner="t")
    for job in (first, second):
        runner._advance_one(job_id=job.pk, owner="t")
        assert _steps(Job.objects.get(pk=job.pk))["vmid"] == StepStatus.DONE
    Job.objects.update(lease_owner="", lease_until=None)

    async def barrier():
        return asyncio.Barrier(2)

    pve.create_barrier = servers_loop.call(barrier())
    results = {}

    def run(job_id):
        try:
            results[job_id] = job_run(job_id)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(j.pk,)) for j in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    statuses = sorted(j.status for j in results.values())
    assert statuses == [JobStatus.FAILED, JobStatus.SUCCEEDED]
    loser = next(j for j in results.values() if j.status == JobStatus.FAILED)
    assert "VMID 144 was taken" in loser.status_reason and "already exists" in loser.status_reason
    assert len([vm for vm in pve.vms if vm.vmid == 144]) == 1
    winner = next(j for j in results.values() if j.status == JobStatus.SUCCEEDED)
    assert pve.vm(144).name == winner.node_name


def test_two_jobs_for_one_vmid_one_after_the_other(pve, hypervisor, vm_ssh, fast):
    first = job_run(services.job_provision_create(request=provision_request(node="node-a")).pk)
    second = job_run(services.job_provision_create(request=provision_request(node="node-b")).pk)
    assert first.status == JobStatus.SUCCEEDED
    assert second.status == JobStatus.FAILED and "VMID 144 is already taken (node-a)" in second.status_reason
    assert len(creates(pve)) == 1


def test_a_vm_made_by_an_earlier_attempt_is_resumed_not_made_again(pve, hypervisor, vm_ssh, fast):
    """A worker killed between the create's answer and recording it: the VM
    carries this job's marker, so the rerun takes it over."""
    job = services.job_provision_create(request=provision_request())
    pve.add_vm(144, "llmgw-node04", node="pve1", config={
        "description": f"Made by llmgw provisioning job {job.pk} (marker {job.marker}).",
        "scsi0": "local-lvm:vm-144-disk-1,size=3G",
    })
    job = job_run(job.pk)
    assert job.status == JobStatus.SUCCEEDED, job.status_reason
    assert _steps(job)["vmid"] == StepStatus.SKIPPED and _steps(job)["create"] == StepStatus.SKIPPED
    assert _steps(job)["resize"] == StepStatus.DONE
    assert creates(pve) == []
    assert "this job's own, from an earlier attempt" in _log(job)


def test_a_task_ending_in_error_fails_the_step_with_proxmox_words(pve, hypervisor, fast):
    pve.fail("POST", "/nodes/pve1/qemu/144/status/start", error="qemu_exited_code")
    job = job_run(services.job_provision_create(request=provision_request()).pk)
    assert job.status == JobStatus.FAILED
    assert _steps(job)["start"] == StepStatus.FAILED
    assert "Start it: the start task failed: QEMU exited with code 1" == job.status_reason
    assert "| TASK ERROR: QEMU exited with code 1" in _log(job)


def test_retry_after_a_failed_task_finishes_the_same_vm(pve, hypervisor, vm_ssh, fast):
    pve.fail("POST", "/nodes/pve1/qemu/144/status/start", error="qemu_exited_code", times=1)
    job = job_run(services.job_provision_create(request=provision_request()).pk)
    assert job.status == JobStatus.FAILED
    services.job_retry(job_id=job.pk)
    job = job_run(job.pk)
    assert job.status == JobStatus.SUCCEEDED, job.status_reason
    assert len(creates(pve)) == 1 and pve.vm(144).status == "running"
    assert "retried" in _log(job)


def test_a_token_lacking_a_privilege_fails_the_job_naming_it(pve, hypervisor, fast):
    from provisioning.choices import VM_PRIVILEGES

    pve.grant("llmgw@pve!prov", "/vms", *[p for p in VM_PRIVILEGES if p != "VM.Config.Memory"])
    pve.grant("llmgw@pve!prov", "/storage/local-lvm", "Datastore.AllocateSpace")
    pve.grant("llmgw@pve!prov", "/storage/local", "Datastore.Audit")
    job = job_run(services.job_provision_create(request=provision_request()).pk)
    assert job.status == JobStatus.FAILED
    assert job.status_reason == (
        "Validate the request: the token llmgw@pve!prov lacks VM.Config.Memory on /vms/144, "
        "SDN.Use on /sdn/zones/localnetwork/vmbr0"
    )
    assert creates(pve) == []

    check = services.hypervisor_check(name="pve")
    assert check["reachable"] and {m["privilege"] for m in check["missing"]} == {"VM.Config.Memory", "SDN.Use"}


def test_a_hypervisor_that_does_not_answer_fails_in_bounded_time(pve, hypervisor, fast):
    fast.LLMGW_PROXMOX_TIMEOUT = 0.5
    fast.LLMGW_PROVISION_UNREACHABLE_DEADLINE = 2.0
    pve.flaky_network(hang_rate=1.0, hang_secs=3)
    job = job_run(services.job_provision_create(request=provision_request()).pk, timeout=30)
    assert job.status == JobStatus.FAILED
    assert f"hypervisor pve at {pve.url} did not answer: ReadTimeout" in job.status_reason
    assert "gave up after 2s" in job.status_reason

    check = services.hypervisor_check(name="pve")
    assert not check["reachable"] and "did not answer" in check["error"]


def test_ssh_that_never_answers_fails_with_a_clear_reason(pve, hypervisor, fast, ssh_port):
    fast.LLMGW_PROVISION_SSH_PORT = ssh_port
    fast.LLMGW_PROVISION_SSH_DEADLINE = 1.0
    job = job_run(services.job_provision_create(request=provision_request()).pk)
    assert job.status == JobStatus.FAILED
    assert f"nothing answered on {VM_HOST}:{ssh_port} within 1s" in job.status_reason
    assert pve.vm(144).status == "running"


def test_cancel_stops_the_job_and_keeps_the_vm(pve, hypervisor, fast):
    job = services.job_provision_create(request=provision_request())
    runner.job_advance(job_id=job.pk)
    services.job_cancel(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLED
    runner.job_advance(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLED
    assert "running" not in _steps(job).values()


def test_a_stale_message_does_nothing(pve, hypervisor, fast):
    job = services.job_provision_create(request=provision_request())
    runner.job_advance(job_id=job.pk, wake=job.wake + 99)
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED and pve.requests == []


def test_stalled_jobs_are_enqueued_again(pve, hypervisor, fast):
    import datetime as dt

    from django.utils import timezone

    job = services.job_provision_create(request=provision_request())
    Job.objects.filter(pk=job.pk).update(
        status=JobStatus.RUNNING, lease_owner="dead-worker", lease_until=timezone.now() - dt.timedelta(seconds=1),
        next_run_at=timezone.now() - dt.timedelta(minutes=5),
    )
    wake = Job.objects.get(pk=job.pk).wake
    assert services.jobs_resume_stalled() == [job.pk]
    assert Job.objects.get(pk=job.pk).wake == wake + 1
    # A live lease is left alone.
    Job.objects.filter(pk=job.pk).update(lease_until=timezone.now() + dt.timedelta(minutes=1),
                                         next_run_at=timezone.now() - dt.timedelta(minutes=5))
    assert services.jobs_resume_stalled() == []
