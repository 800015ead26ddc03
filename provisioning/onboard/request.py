"""Onboarding requests: checked as plain functions (the API's serializer and
the job's steps call the same ones), and the job that runs them."""

from __future__ import annotations

import ipaddress
import re
from pathlib import PurePosixPath
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from agent.protocol import FABRIC_NAME_RE, HCA_NAME_RE
from core.events import event_record
from nodes.choices import NodeStatus
from nodes.models import Node
from nodes.validation import mgmt_addr_check
from pki.names import InvalidNodeId, validate_node_id

from .. import queue, stepkit
from ..choices import JobKind, JobStatus, ProvisioningEventKind
from ..models import Job
from ..validation import RequestInvalid

# The seeds' meaning of a bare `--fabric NAME`: its two default adapters.
DEFAULT_HCAS = ("mlx5_0", "mlx5_1")
FINGERPRINT_RE = re.compile(r"^SHA256:[A-Za-z0-9+/]{43}=?$")
HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
USER_RE = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")
INTERFACE_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")


def fabrics_parse(specs: list[str]) -> list[dict[str, Any]]:
    """``ib-b:mlx5_2,mlx5_3`` or ``ib-b`` (then mlx5_0,mlx5_1). An HCA named
    under two fabrics is kept: the preflight refuses it, naming both."""
    fabrics: list[dict[str, Any]] = []
    for spec in specs:
        name, sep, hca_text = str(spec).partition(":")
        if not FABRIC_NAME_RE.match(name):
            raise RequestInvalid({"fabrics": f"{spec!r}: {name!r} is not a fabric name (letters, digits, _ . -)"})
        hcas = [h.strip() for h in hca_text.split(",") if h.strip()] if sep else list(DEFAULT_HCAS)
        if not hcas or any(not HCA_NAME_RE.match(h) for h in hcas):
            raise RequestInvalid({"fabrics": f"{spec!r}: give its HCAs as NAME:mlx5_0,mlx5_1"})
        if any(f["name"] == name for f in fabrics):
            raise RequestInvalid({"fabrics": f"fabric {name} is given twice; list all its HCAs once"})
        fabrics.append({"name": name, "hcas": hcas})
    return fabrics


def hcas_in_two_fabrics(fabrics: list[dict[str, Any]]) -> list[str]:
    owner: dict[str, str] = {}
    problems = []
    for fabric in fabrics:
        for hca in fabric["hcas"]:
            if hca in owner and owner[hca] != fabric["name"]:
                problems.append(f"HCA {hca} is under two fabrics ({owner[hca]} and {fabric['name']}); "
                                "an adapter is on one fabric")
            owner.setdefault(hca, fabric["name"])
    return problems


# Paths that go into the unit's command line and shell commands: nothing a
# shell or systemd would read as more than a path (no space, quote, $, %, ;).
NODE_PATH_RE = re.compile(r"^/[A-Za-z0-9._+@/-]*$")


def _absolute(errors: dict, field: str, value: str, default: str) -> str:
    value = str(value or default)
    if not PurePosixPath(value).is_absolute() or not NODE_PATH_RE.match(value) or "/../" in f"{value}/":
        errors[field] = (f"{value[:200]!r}: an absolute path on the node, of letters, digits and . _ + @ - / "
                         "(no spaces, quotes, $, % or ..)")
    return value


def onboard_request_check(data: dict[str, Any]) -> dict[str, Any]:
    """The cleaned parameters of an onboarding job, or RequestInvalid by field."""
    errors: dict[str, str] = {}
    clean: dict[str, Any] = {}
    try:
        clean["node"] = validate_node_id(data.get("node") or "")
    except InvalidNodeId as exc:
        errors["node"] = str(exc)
    addr = str(data.get("addr") or "")
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        if not HOSTNAME_RE.match(addr):
            errors["addr"] = f"{addr!r}: the node's address (IP or host name) to reach it over SSH"
    clean["addr"] = addr
    user = str(data.get("ssh_user") or "root")
    if not USER_RE.match(user):
        errors["ssh_user"] = f"{user!r} is not a user name"
    clean["ssh_user"] = user
    port = data.get("ssh_port", 22)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        errors["ssh_port"] = f"{port!r}: a TCP port"
    clean["ssh_port"] = port
    try:
        clean["fabrics"] = fabrics_parse(list(data.get("fabrics") or []))
    except RequestInvalid as exc:
        errors.update(exc.errors)
    interface = str(data.get("mgmt_interface") or "eth0")
    if not INTERFACE_RE.match(interface):
        errors["mgmt_interface"] = f"{interface!r} is not a network interface name"
    clean["mgmt_interface"] = interface
    mgmt_addr = str(data.get("mgmt_addr") or addr)
    problem = mgmt_addr_check(mgmt_addr) if "addr" not in errors or data.get("mgmt_addr") else ""
    if problem:
        given = "" if data.get("mgmt_addr") else " (it defaults to addr)"
        errors["mgmt_addr"] = f"{problem}{given}: the node's address where the gateway reaches its engines"
    clean["mgmt_addr"] = mgmt_addr
    nvidia_smi = str(data.get("nvidia_smi") or "")
    if nvidia_smi:
        _absolute(errors, "nvidia_smi", nvidia_smi, "")
    clean["nvidia_smi"] = nvidia_smi
    clean["ib_root"] = _absolute(errors, "ib_root", data.get("ib_root"), "/sys/class/infiniband")
    clean["skip_gpus"] = bool(data.get("skip_gpus"))
    clean["reinstall"] = bool(data.get("reinstall"))
    fingerprint = str(data.get("host_key_fingerprint") or "")
    if fingerprint and not FINGERPRINT_RE.match(fingerprint):
        errors["host_key_fingerprint"] = (f"{fingerprint!r}: give it as ssh-keygen -lf prints it, SHA256:... "
                                          "(43 base64 characters)")
    clean["host_key_fingerprint"] = fingerprint
    engine_user = str(settings.LLMGW_ENGINE_USER)
    if not USER_RE.match(engine_user) or engine_user == "root":
        errors["engine_user"] = (f"LLMGW_ENGINE_USER={engine_user!r} is not an unprivileged user name; "
                                 "engines must not run as root")
    clean["engine_user"] = engine_user
    server = str(data.get("agent_server") or settings.LLMGW_AGENT_SERVER)
    if not server.startswith("https://"):
        errors["agent_server"] = (f"{server!r}: the agent API's https:// address as the node reaches it "
                                  "(set LLMGW_AGENT_SERVER or give agent_server)")
    clean["server"] = server
    root = _absolute(errors, "root", data.get("root"), "/")
    clean["root"] = root
    base = PurePosixPath(root)
    for field, default in (("etc_dir", base / "etc/llmgw"), ("unit_dir", base / "etc/systemd/system")):
        given = data.get(field)
        clean[field] = _absolute(errors, field, given, "") if given else str(default)
    if errors:
        raise RequestInvalid(errors)
    return clean


def node_heartbeats(node_name: str) -> bool:
    """A node that is known and not lost: onboarding it again needs --reinstall."""
    return Node.objects.filter(name=node_name).exclude(status=NodeStatus.LOST).exists()


def job_onboard_create(*, request: dict[str, Any], user=None) -> Job:
    clean = onboard_request_check(request)
    node = clean.pop("node")
    if not clean["reinstall"] and node_heartbeats(node):
        raise RequestInvalid({"node": f"{node} is already a node of this cluster and heartbeats; "
                                      "onboard it again only with reinstall (--reinstall)"})
    try:
        with transaction.atomic():
            job = Job.objects.create(
                kind=JobKind.ONBOARD, node_name=node, params=clean, status=JobStatus.QUEUED,
                status_changed_at=timezone.now(),
                created_by=user if user is not None and user.is_authenticated else None,
            )
            stepkit.job_steps_create(job)
            fabrics = ", ".join(f"{f['name']}:{','.join(f['hcas'])}" for f in clean["fabrics"]) or "none (island)"
            event_record(kind=ProvisioningEventKind.PROVISIONING, subject=f"job/{job.pk}",
                         message=f"onboard {node} at {clean['addr']} (fabrics {fabrics}) queued"
                         + (f" by {user.get_username()}" if job.created_by else ""))
            queue.job_enqueue(job_id=job.pk)
    except IntegrityError:
        raise RequestInvalid({"node": f"a job for {node} is already running; 'llmgw ctl jobs' shows it"}) from None
    return job


def onboard_after_provision(job: Job) -> None:
    """A provisioning job that asked for it (``ctl provision --onboard``) is
    followed by onboarding the new VM, over the host key it pinned."""
    request = job.params.get("onboard")
    if request is None:
        return
    request = {"ssh_user": job.hypervisor.ciuser if job.hypervisor else "",
               "ssh_port": settings.LLMGW_PROVISION_SSH_PORT, **request,
               "node": job.node_name, "addr": job.params["ip"].split("/")[0]}
    try:
        follow = job_onboard_create(request=request, user=job.created_by)
    except RequestInvalid as exc:
        event_record(kind=ProvisioningEventKind.PROVISIONING, subject=f"job/{job.pk}", severity="error",
                     message=f"provision {job.node_name} succeeded but its onboarding was refused: {exc}")
        return
    event_record(kind=ProvisioningEventKind.PROVISIONING, subject=f"job/{job.pk}",
                 message=f"provision {job.node_name} succeeded; onboarding is job {follow.pk}")
