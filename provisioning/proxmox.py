"""The Proxmox VE API, through proxmoxer (https backend, API token).

Errors come out as ProxmoxError with Proxmox's own wording, or as
ProxmoxUnreachable when the hypervisor did not answer. Nothing here logs or
returns the token secret.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests
from django.conf import settings
from proxmoxer import ProxmoxAPI
from proxmoxer.core import AuthenticationError, ResourceException

from .choices import VM_PRIVILEGES
from .models import Hypervisor
from .vault import secret_decrypt


class ProxmoxError(Exception):
    def __init__(self, status: int, message: str, errors: dict | None = None):
        self.status = status
        self.message = message
        self.errors = errors or {}
        detail = "; ".join(f"{k}: {str(v).strip()}" for k, v in self.errors.items())
        super().__init__(f"{message.strip()}" + (f" ({detail})" if detail else ""))


class ProxmoxUnreachable(ProxmoxError):
    """No answer: refused, timed out, TLS failure."""


@dataclass(frozen=True)
class Privilege:
    name: str
    path: str


def needed_privileges(hypervisor: Hypervisor, vmid: int | None = None) -> list[Privilege]:
    """What a provisioning job needs, on the paths Proxmox checks them."""
    if hypervisor.pool:
        vm_path = f"/pool/{hypervisor.pool}"
    else:
        vm_path = f"/vms/{vmid}" if vmid else "/vms"
    needed = [Privilege(name, vm_path) for name in VM_PRIVILEGES]
    needed.append(Privilege("Datastore.AllocateSpace", f"/storage/{hypervisor.storage}"))
    image_storage = hypervisor.image.split(":", 1)[0]
    needed.append(Privilege("Datastore.Audit", f"/storage/{image_storage}"))
    needed.append(Privilege("SDN.Use", f"/sdn/zones/localnetwork/{hypervisor.bridge}"))
    return needed


def _ca_file(pem: str) -> str:
    """requests wants a file: the hypervisor's CA, written once under the data dir."""
    digest = hashlib.sha256(pem.encode()).hexdigest()[:16]
    path = Path(settings.DATA_DIR) / "provisioning" / f"ca-{digest}.pem"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{id(pem)}.tmp")
        tmp.write_text(pem)
        tmp.replace(path)
    return str(path)


def _size_gib(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", value.strip())
    if not match:
        return 0.0
    number, unit = float(match.group(1)), match.group(2)
    return number * {"": 1 / 1024**3, "K": 1 / 1024**2, "M": 1 / 1024, "G": 1, "T": 1024}[unit]


def disk_size_gib(drive: str) -> float:
    """The size= of a drive value ('local-lvm:vm-144-disk-1,size=200G'), in GiB."""
    for part in drive.split(",")[1:]:
        key, _, value = part.partition("=")
        if key == "size":
            return _size_gib(value)
    return 0.0


class Proxmox:
    def __init__(self, hypervisor: Hypervisor, *, timeout: float | None = None):
        parts = urlsplit(hypervisor.url)
        user, _, token_name = hypervisor.token_id.partition("!")
        self.where = f"hypervisor {hypervisor.name} at {hypervisor.url}"
        self.api = ProxmoxAPI(
            parts.hostname,
            port=parts.port or 8006,
            user=user,
            token_name=token_name,
            token_value=secret_decrypt(hypervisor.token_secret_encrypted),
            verify_ssl=_ca_file(hypervisor.ca_pem) if hypervisor.ca_pem else True,
            timeout=timeout or settings.LLMGW_PROXMOX_TIMEOUT,
            service="PVE",
        )

    def _call(self, fn, *args, **kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except ResourceException as exc:
            message = str(exc.content or exc.status_message)
            errors = exc.errors if isinstance(exc.errors, dict) else {}
            raise ProxmoxError(exc.status_code, message, errors) from None
        except AuthenticationError as exc:
            raise ProxmoxError(401, f"{self.where} refused the API token: {exc}") from None
        except requests.exceptions.SSLError as exc:
            raise ProxmoxUnreachable(0, f"{self.where}: TLS verification failed ({type(exc).__name__}); "
                                        "is the hypervisor's CA file right?") from None
        except requests.exceptions.RequestException as exc:
            raise ProxmoxUnreachable(0, f"{self.where} did not answer: {type(exc).__name__}") from None

    def version(self) -> dict:
        return self._call(self.api.version.get)

    def node_names(self) -> list[str]:
        return [n["node"] for n in self._call(self.api.nodes.get)]

    def permissions(self, path: str) -> set[str]:
        """The privileges the token holds on path (including what it inherits)."""
        held: set[str] = set()
        answer = self._call(self.api.access.permissions.get, path=path) or {}
        for granted, privs in answer.items():
            if granted == "/" or path == granted or path.startswith(granted.rstrip("/") + "/"):
                held.update(name for name, value in privs.items() if value)
        return held

    def vmid_free(self, vmid: int) -> bool:
        """/cluster/nextid sees every VMID, including VMs the token may not audit."""
        try:
            self._call(self.api.cluster.nextid.get, vmid=vmid)
        except ProxmoxError as exc:
            if exc.status == 400 and "already exists" in str(exc.errors.get("vmid", "")):
                return False
            raise
        return True

    def vm_config(self, node: str, vmid: int) -> dict | None:
        try:
            return self._call(self.api.nodes(node).qemu(vmid).config.get)
        except ProxmoxError as exc:
            if exc.status == 500 and "does not exist" in exc.message:
                return None
            raise

    def vm_create(self, node: str, params: dict[str, Any]) -> str:
        return self._call(self.api.nodes(node).qemu.post, **params)

    def vm_resize(self, node: str, vmid: int, disk: str, size: str) -> str | None:
        return self._call(self.api.nodes(node).qemu(vmid).resize.put, disk=disk, size=size)

    def vm_status(self, node: str, vmid: int) -> str:
        return self._call(self.api.nodes(node).qemu(vmid).status.current.get)["status"]

    def vm_start(self, node: str, vmid: int) -> str:
        return self._call(self.api.nodes(node).qemu(vmid).status.start.post)

    def task_status(self, node: str, upid: str) -> dict:
        return self._call(self.api.nodes(node).tasks(upid).status.get)

    def task_log(self, node: str, upid: str, limit: int = 30) -> list[str]:
        lines = self._call(self.api.nodes(node).tasks(upid).log.get, limit=500) or []
        return [str(line.get("t", "")) for line in lines][-limit:]


def task_node(upid: str) -> str:
    """The node a task runs on, from its UPID (UPID:node:pid:...)."""
    return upid.split(":")[1]
