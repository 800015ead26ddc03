"""Checks of what an operator asks for, as plain functions: the API's
serializers and the job's validate step call the same ones."""

from __future__ import annotations

import ipaddress
import re
from typing import Any
from urllib.parse import urlsplit

from nodes.models import Node
from pki.names import InvalidNodeId, validate_node_id

from .models import Hypervisor

VMID_MIN, VMID_MAX = 100, 999_999_999
HYPERVISOR_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$")
TOKEN_ID_RE = re.compile(r"^[^\s@!]+@[^\s@!]+![A-Za-z][A-Za-z0-9._-]*$")
VOLUME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9._-]*:[^\s,]+$")
PVE_ID_RE = re.compile(r"^[A-Za-z][A-Za-z0-9._-]*$")
DISK_RE = re.compile(r"^\d+G$")
# Names the hypervisors API uses for its own routes.
RESERVED_NAMES = {"ssh-key"}


class RequestInvalid(ValueError):
    """Bad input, by field: nothing was touched."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{field}: {message}" for field, message in errors.items()))


def hypervisor_fields_check(data: dict[str, Any]) -> None:
    errors: dict[str, str] = {}
    name = data.get("name")
    if name is not None and (not HYPERVISOR_NAME_RE.match(name) or name in RESERVED_NAMES):
        errors["name"] = f"{name!r} is not a usable name: 1-63 lowercase letters, digits, '-', '_' or '.'"
    url = data.get("url")
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme != "https" or not parts.hostname or parts.path not in ("", "/"):
            errors["url"] = f"{url!r}: give the API's address as https://host:8006"
    token_id = data.get("token_id")
    if token_id is not None and not TOKEN_ID_RE.match(token_id):
        errors["token_id"] = f"{token_id!r} is not a Proxmox API token id: user@realm!tokenname"
    image = data.get("image")
    if image is not None and not VOLUME_RE.match(image):
        errors["image"] = (
            f"{image!r} is not a storage volume: give one such as local:import/noble.qcow2 "
            "(an API token can never import from an absolute path)"
        )
    for field in ("storage", "bridge", "pool", "node"):
        value = data.get(field)
        if value and not PVE_ID_RE.match(value):
            errors[field] = f"{value!r} is not a valid Proxmox {field} name"
    for line in (data.get("ssh_keys") or "").splitlines():
        if line.strip() and not re.match(r"^(ssh-(ed25519|rsa)|ecdsa-sha2-nistp\d+|sk-\S+) [A-Za-z0-9+/=]+( .*)?$", line.strip()):
            errors["ssh_keys"] = f"not an SSH public key line: {line.strip()[:40]!r}"
            break
    ca_pem = data.get("ca_pem")
    if ca_pem and "-----BEGIN CERTIFICATE-----" not in ca_pem:
        errors["ca_pem"] = "not a PEM certificate"
    if errors:
        raise RequestInvalid(errors)


# Where the token's secret is sent, and whom it trusts there.
SECRET_BOUND_FIELDS = ("url", "ca_pem")


def hypervisor_secret_check(*, changed: list[str], token_secret: str) -> None:
    """Changing where the token's secret goes (the API's address, the CA that
    vouches for it) needs the secret given again: otherwise anyone who may
    change a hypervisor could aim the stored secret at a server of theirs."""
    moved = [field for field in SECRET_BOUND_FIELDS if field in changed]
    if moved and not token_secret:
        raise RequestInvalid({"token_secret": (
            f"changing {' and '.join(moved)} sends the API token's secret to another place: "
            "give the token's secret again (token_secret) with the change")})


def provision_request_check(data: dict[str, Any]) -> dict[str, Any]:
    """The cleaned parameters of a provisioning job, or RequestInvalid naming each bad field."""
    errors: dict[str, str] = {}
    clean: dict[str, Any] = {}
    try:
        clean["node"] = validate_node_id(data.get("node") or "")
    except InvalidNodeId as exc:
        errors["node"] = str(exc)
    else:
        if Node.objects.filter(name=clean["node"]).exists():
            errors["node"] = f"{clean['node']} is already a node of this cluster"

    hypervisor = data.get("hypervisor") or ""
    if not hypervisor:
        names = list(Hypervisor.objects.values_list("name", flat=True)[:2])
        if len(names) == 1:
            hypervisor = names[0]
        else:
            errors["hypervisor"] = "no hypervisor is defined" if not names else "several hypervisors: name one"
    elif not Hypervisor.objects.filter(name=hypervisor).exists():
        errors["hypervisor"] = f"no hypervisor named {hypervisor!r}; 'llmgw ctl hypervisors' lists them"
    clean["hypervisor"] = hypervisor

    vmid = data.get("vmid")
    if isinstance(vmid, bool) or not isinstance(vmid, int) or not VMID_MIN <= vmid <= VMID_MAX:
        errors["vmid"] = f"{vmid!r}: a VMID is an integer from {VMID_MIN} to {VMID_MAX}"
    clean["vmid"] = vmid

    network = None
    try:
        interface = ipaddress.ip_interface(str(data.get("ip") or ""))
        if "/" not in str(data.get("ip")):
            raise ValueError("no prefix length")
        network = interface.network
        if interface.ip in (network.network_address, network.broadcast_address) and network.prefixlen < 31:
            raise ValueError("the network or broadcast address")
        clean["ip"] = str(interface)
    except ValueError as exc:
        errors["ip"] = f"{data.get('ip')!r} is not an address with its prefix, such as 10.0.0.144/24 ({exc})"
    try:
        gateway = ipaddress.ip_address(str(data.get("gateway") or ""))
        if network is not None and gateway not in network:
            errors["gateway"] = f"{gateway} is outside {network}"
        clean["gateway"] = str(gateway)
    except ValueError:
        errors["gateway"] = f"{data.get('gateway')!r} is not an IP address"

    for field, low, high in (("cores", 1, 1024), ("memory", 512, 16 * 1024 * 1024)):
        value = data.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            errors[field] = f"{value!r}: an integer from {low} to {high}" + (" (MiB)" if field == "memory" else "")
        clean[field] = value
    disk = str(data.get("disk") or "")
    if not DISK_RE.match(disk) or int(disk[:-1]) < 1:
        errors["disk"] = f"{disk!r}: a size in GiB such as 200G"
    clean["disk"] = disk
    nameservers = str(data.get("nameserver") or "").split()
    for server in nameservers:
        try:
            ipaddress.ip_address(server)
        except ValueError:
            errors["nameserver"] = f"{server!r} is not an IP address"
    clean["nameserver"] = " ".join(nameservers)
    if errors:
        raise RequestInvalid(errors)
    return clean
