"""The provisioning job's steps: a Proxmox VM made from a cloud image, up to
SSH (then onboarding, provisioning/onboard/, takes over when asked).

Each step looks at the hypervisor first and skips what an earlier attempt
already did; the VM's description carries the job's marker, so a VM this job
made is told apart from anyone else's.
"""

from __future__ import annotations

import asyncio
import functools
from urllib.parse import quote

import asyncssh
from django.conf import settings

from . import services, sshkeys
from .choices import JobKind
from .exceptions import StepFailed
from .models import Job
from .proxmox import Proxmox, ProxmoxError, ProxmoxUnreachable, disk_size_gib, task_node
from .stepkit import Done, Skipped, StepContext, StepSpec, Wait
from .validation import RequestInvalid, provision_request_check

KIND = JobKind.PROVISION
TAGS = "llmgw"


def _talks_to_proxmox(run):
    """A hypervisor that does not answer is waited for, up to a deadline; any
    other refusal fails the step with Proxmox's own words."""

    @functools.wraps(run)
    def wrapper(ctx: StepContext):
        try:
            outcome = run(ctx, _api(ctx.job))
        except ProxmoxUnreachable as exc:
            left = ctx.deadline("unreachable_until", settings.LLMGW_PROVISION_UNREACHABLE_DEADLINE)
            if left <= 0:
                raise StepFailed(
                    f"{exc} (gave up after {settings.LLMGW_PROVISION_UNREACHABLE_DEADLINE:.0f}s); "
                    "check that the hypervisor is up and its address is right, then retry the job"
                ) from None
            ctx.log(f"{exc}; trying again")
            return Wait(min(ctx.backoff("unreachable_poll", start=1.0, ceiling=30.0), max(left, 0.1)))
        except ProxmoxError as exc:
            raise StepFailed(f"Proxmox refused: {exc}") from None
        ctx.data.pop("unreachable_until", None)
        ctx.data.pop("unreachable_poll", None)
        return outcome

    return wrapper


def _api(job: Job) -> Proxmox:
    if job.hypervisor is None:
        raise StepFailed("the job's hypervisor was removed")
    return Proxmox(job.hypervisor)


def _pve_node(ctx: StepContext) -> str:
    return ctx.job.steps.get(name="validate").data["pve_node"]


def _vmid(ctx: StepContext) -> int:
    return ctx.job.params["vmid"]


def _is_ours(job: Job, config: dict | None) -> bool:
    return bool(config) and config.get("name") == job.node_name and job.marker in str(config.get("description", ""))


def _task_wait(ctx: StepContext, api: Proxmox, what: str) -> Done | Wait:
    """Poll the step's Proxmox task once: Wait while it runs, Done when it ended well."""
    upid = ctx.data["upid"]
    status = api.task_status(task_node(upid), upid)
    if status.get("status") != "stopped":
        left = ctx.deadline("task_until", settings.LLMGW_PROVISION_TASK_DEADLINE)
        if left <= 0:
            raise StepFailed(f"the {what} task {upid} was still running after "
                             f"{settings.LLMGW_PROVISION_TASK_DEADLINE:.0f}s; see it in the Proxmox task log")
        return Wait(ctx.backoff("poll", start=settings.LLMGW_PROVISION_POLL_MIN,
                                ceiling=settings.LLMGW_PROVISION_POLL_MAX))
    exitstatus = str(status.get("exitstatus", ""))
    if exitstatus == "OK" or exitstatus.startswith("WARNINGS"):
        return Done(f"{what}: task {exitstatus}")
    for line in api.task_log(task_node(upid), upid):
        ctx.log(f"| {line}")
    raise StepFailed(f"the {what} task failed: {exitstatus}")


def _task_started(ctx: StepContext, upid: str | None, what: str) -> None:
    ctx.data["upid"] = upid
    for key in ("poll", "task_until"):
        ctx.data.pop(key, None)
    ctx.log(f"{what}: task {upid}")


@_talks_to_proxmox
def validate(ctx: StepContext, api: Proxmox):
    job = ctx.job
    request = dict(job.params, node=job.node_name, hypervisor=job.hypervisor.name)
    try:
        provision_request_check(request)
    except RequestInvalid as exc:
        raise StepFailed(str(exc)) from None
    version = api.version().get("version", "?")
    ctx.log(f"{job.hypervisor.name} answers: Proxmox VE {version}")
    node = job.hypervisor.node
    if not node:
        names = api.node_names()
        if len(names) != 1:
            raise StepFailed(f"the cluster has nodes {', '.join(names)}: set the hypervisor's node")
        node = names[0]
    ctx.data["pve_node"] = node
    missing = services.privileges_missing(api, job.hypervisor, vmid=job.params["vmid"])
    if missing:
        raise StepFailed(f"the token {job.hypervisor.token_id} lacks "
                         + ", ".join(f"{p.name} on {p.path}" for p in missing))
    return Done(f"request valid; the token holds every privilege needed on node {node}")


@_talks_to_proxmox
def vmid_free(ctx: StepContext, api: Proxmox):
    vmid = _vmid(ctx)
    if api.vmid_free(vmid):
        return Done(f"VMID {vmid} is free")
    config = api.vm_config(_pve_node(ctx), vmid)
    if _is_ours(ctx.job, config):
        if config.get("lock") == "create":
            return Wait(settings.LLMGW_PROVISION_POLL_MIN, f"VM {vmid} is this job's own and still being created")
        return Skipped(f"VM {vmid} is this job's own, from an earlier attempt: resuming")
    name = f" ({config.get('name')})" if config else ""
    raise StepFailed(f"VMID {vmid} is already taken{name}; nothing was created. Choose another --vmid")


def create_params(job: Job) -> dict:
    hypervisor, p = job.hypervisor, job.params
    keys = [sshkeys.control_plane_public_key()] + [k.strip() for k in hypervisor.ssh_keys.splitlines() if k.strip()]
    params = {
        "vmid": p["vmid"],
        "name": job.node_name,
        "cores": p["cores"],
        "memory": p["memory"],
        "scsihw": "virtio-scsi-pci",
        "scsi0": f"{hypervisor.storage}:0,import-from={hypervisor.image}",
        "ide2": f"{hypervisor.storage}:cloudinit",
        "boot": "order=scsi0",
        "serial0": "socket",
        "vga": "serial0",
        "agent": 1,
        "net0": f"virtio,bridge={hypervisor.bridge}",
        "ciuser": hypervisor.ciuser,
        # Proxmox wants the keys URL-encoded with nothing left safe (quote_plus is refused).
        "sshkeys": quote("\n".join(keys) + "\n", safe=""),
        "ipconfig0": f"ip={p['ip']},gw={p['gateway']}",
        "ciupgrade": 0,
        "tags": TAGS,
        "description": f"Made by llmgw provisioning job {job.pk} for node {job.node_name} (marker {job.marker}).",
    }
    nameserver = p.get("nameserver") or hypervisor.nameserver
    if nameserver:
        params["nameserver"] = nameserver
    if hypervisor.pool:
        params["pool"] = hypervisor.pool
    return params


@_talks_to_proxmox
def create(ctx: StepContext, api: Proxmox):
    vmid, node = _vmid(ctx), _pve_node(ctx)
    if ctx.data.get("upid"):
        return _task_wait(ctx, api, "create")
    config = api.vm_config(node, vmid)
    if config is not None:
        if not _is_ours(ctx.job, config):
            raise StepFailed(f"VMID {vmid} was taken by someone else ({config.get('name')}) while this job ran")
        if config.get("lock") == "create":
            return Wait(settings.LLMGW_PROVISION_POLL_MIN, f"VM {vmid} is still being created")
        return Skipped(f"VM {vmid} exists: made by an earlier attempt of this job")
    try:
        upid = api.vm_create(node, create_params(ctx.job))
    except ProxmoxError as exc:
        if exc.status == 500 and "already exists" in exc.message:
            # The create is the real guard: another creator won the race.
            raise StepFailed(f"VMID {vmid} was taken while this job ran ({exc}); nothing was created") from None
        raise
    _task_started(ctx, upid, f"creating VM {vmid} on {node}")
    return _task_wait(ctx, api, "create")


@_talks_to_proxmox
def resize(ctx: StepContext, api: Proxmox):
    vmid, node = _vmid(ctx), _pve_node(ctx)
    if ctx.data.get("upid"):
        return _task_wait(ctx, api, "resize")
    want = ctx.job.params["disk"]
    config = api.vm_config(node, vmid) or {}
    if disk_size_gib(str(config.get("scsi0", ""))) >= float(want[:-1]):
        return Skipped(f"scsi0 is already {want} or larger")
    upid = api.vm_resize(node, vmid, "scsi0", want)
    if not upid:
        return Done(f"scsi0 resized to {want}")
    _task_started(ctx, upid, f"resizing scsi0 to {want}")
    return _task_wait(ctx, api, "resize")


@_talks_to_proxmox
def start(ctx: StepContext, api: Proxmox):
    vmid, node = _vmid(ctx), _pve_node(ctx)
    if ctx.data.get("upid"):
        return _task_wait(ctx, api, "start")
    if api.vm_status(node, vmid) == "running":
        return Skipped(f"VM {vmid} is already running")
    _task_started(ctx, api.vm_start(node, vmid), f"starting VM {vmid}")
    return _task_wait(ctx, api, "start")


def ssh_ready(ctx: StepContext):
    host = ctx.job.params["ip"].split("/")[0]
    port = settings.LLMGW_PROVISION_SSH_PORT
    left = ctx.deadline("ssh_until", settings.LLMGW_PROVISION_SSH_DEADLINE)
    if not sshkeys.tcp_answers(host, port, timeout=min(5.0, max(left, 0.5))):
        if left <= 0:
            raise StepFailed(f"nothing answered on {host}:{port} within {settings.LLMGW_PROVISION_SSH_DEADLINE:.0f}s "
                             "of the start: check the VM's console (serial0) for cloud-init or network errors")
        return Wait(ctx.backoff("poll", start=settings.LLMGW_PROVISION_POLL_MIN, ceiling=settings.LLMGW_PROVISION_POLL_MAX))
    try:
        key = sshkeys.host_key_fetch(host, port, timeout=30.0)
    except (OSError, asyncio.TimeoutError, asyncssh.Error) as exc:
        if left <= 0:
            raise StepFailed(f"{host}:{port} answers but presented no SSH host key: {exc}") from None
        ctx.log(f"{host}:{port} answers; no host key yet ({type(exc).__name__})")
        return Wait(ctx.backoff("poll", start=settings.LLMGW_PROVISION_POLL_MIN, ceiling=settings.LLMGW_PROVISION_POLL_MAX))
    pinned = services.job_host_key_pin(job_id=ctx.job.pk, host_key=key)
    return Done(f"{host}:{port} answers; host key {sshkeys.fingerprint(pinned)} pinned for onboarding")


PROVISION_STEPS = [
    StepSpec("validate", "Validate the request", validate),
    StepSpec("vmid", "Check that the VMID is free", vmid_free),
    StepSpec("create", "Create the VM", create),
    StepSpec("resize", "Resize its disk", resize),
    StepSpec("start", "Start it", start),
    StepSpec("ssh", "Wait for SSH and pin its host key", ssh_ready),
]
