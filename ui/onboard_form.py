"""The web UI's onboarding forms (Add existing machine, New VM's "onboard it",
a node's Re-onboard): what the operator typed, turned into the request the
REST API and ``llmgw ctl`` send to the same services. Pure functions: no
database, no network."""

from __future__ import annotations

from typing import Any

# Text inputs of the Add existing machine form, by the request's field names.
ONBOARD_TEXT = ("node", "addr", "ssh_port", "ssh_user", "fabrics", "mgmt_interface", "nvidia_smi", "ib_root",
                "host_key_fingerprint")
# Its checkboxes; "confirmed" is the form's own ("I compared it"), never sent.
ONBOARD_FLAGS = ("skip_gpus", "reinstall", "confirmed")
# New VM's onboarding inputs (prefixed there, as the VM has fields of its own).
VM_ONBOARD_TEXT = ("ssh_user", "fabrics", "mgmt_interface")
VM_ONBOARD_PREFIX = "ob_"
# Re-onboard: the Add form's inputs less node (the page's) and reinstall (always).
REONBOARD_TEXT = ("addr", "ssh_port", "ssh_user", "fabrics", "mgmt_interface", "nvidia_smi", "ib_root",
                  "agent_server", "host_key_fingerprint")
# Where the agent was installed: kept from the node's last onboarding job.
CARRIED = ("root", "etc_dir", "unit_dir")
HOST_KEY_FILES = {"ssh-ed25519": "ed25519", "ecdsa-sha2-nistp256": "ecdsa", "ecdsa-sha2-nistp384": "ecdsa",
                  "ecdsa-sha2-nistp521": "ecdsa", "ssh-rsa": "rsa"}


def form_read(post, text: tuple[str, ...], flags: tuple[str, ...] = (), prefix: str = "") -> dict[str, Any]:
    """The posted values, stripped; a checkbox is True when it was sent."""
    form: dict[str, Any] = {f: str(post.get(prefix + f, "")).strip() for f in text}
    form.update({f: bool(post.get(prefix + f)) for f in flags})
    return form


def fabrics_split(text: str) -> list[str]:
    """One fabric per line or separated by spaces: ``ib-a:mlx5_0,mlx5_1 ib-b``."""
    return text.split()


def fabrics_text(fabrics: list) -> str:
    """A job's fabrics (cleaned ``{"name", "hcas"}`` or as given) for the form."""
    return "\n".join(f if isinstance(f, str) else f"{f['name']}:{','.join(f['hcas'])}" for f in fabrics or ())


def _port(value: str, errors: dict[str, str]) -> Any:
    try:
        return int(value)
    except ValueError:
        errors["ssh_port"] = f"{value!r}: give the SSH port as a whole number"
        return value


def onboard_request(form: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The request as a JSON body to POST /api/v1/jobs/onboard/ carries it
    (an empty field left out, so the service's default applies), and the
    errors found before the service is asked (a port that is no number)."""
    errors: dict[str, str] = {}
    request: dict[str, Any] = {}
    for field in ONBOARD_TEXT + ("agent_server",):
        value = form.get(field, "")
        if field == "fabrics" or not value:
            continue
        request[field] = _port(value, errors) if field == "ssh_port" else value
    request["fabrics"] = fabrics_split(form.get("fabrics", ""))
    request["skip_gpus"] = bool(form.get("skip_gpus"))
    request["reinstall"] = bool(form.get("reinstall"))
    return request, errors


def vm_onboard_body(form: dict[str, Any]) -> dict[str, Any]:
    """New VM's ``onboard`` as ``llmgw ctl provision --onboard`` sends it
    (cli/ctl/provisioning.py onboard_body): fabrics and skip_gpus always,
    another field only when given."""
    body: dict[str, Any] = {"fabrics": fabrics_split(form.get("fabrics", "")), "skip_gpus": bool(form.get("skip_gpus"))}
    for field in VM_ONBOARD_TEXT:
        if field != "fabrics" and form.get(field):
            body[field] = form[field]
    return body


def reonboard_prefill(*, last: dict[str, Any] | None, mgmt_addr: str, mgmt_interface: str,
                      hcas: list[tuple[str, str | None]], gpus: int, agent_server: str) -> dict[str, Any]:
    """The Re-onboard form's values: the node's last onboarding job's
    parameters, or lacking one, what the node reported (its address, its
    HCAs by fabric; no GPU means skip GPUs). The fingerprint starts empty."""
    if last:
        return {
            "addr": last.get("addr", ""), "ssh_port": str(last.get("ssh_port", 22)),
            "ssh_user": last.get("ssh_user", "root"), "fabrics": fabrics_text(last.get("fabrics", [])),
            "mgmt_interface": last.get("mgmt_interface", ""), "nvidia_smi": last.get("nvidia_smi", ""),
            "ib_root": last.get("ib_root", ""), "skip_gpus": bool(last.get("skip_gpus")),
            "agent_server": last.get("server") or agent_server, "host_key_fingerprint": "",
        }
    by_fabric: dict[str, list[str]] = {}
    for hca, fabric in hcas:
        if fabric:
            by_fabric.setdefault(fabric, []).append(hca)
    return {
        "addr": mgmt_addr, "ssh_port": "22", "ssh_user": "root",
        "fabrics": "\n".join(f"{name}:{','.join(sorted(names))}" for name, names in sorted(by_fabric.items())),
        "mgmt_interface": mgmt_interface, "nvidia_smi": "", "ib_root": "", "skip_gpus": gpus == 0,
        "agent_server": agent_server, "host_key_fingerprint": "",
    }


def reonboard_carried(last: dict[str, Any] | None) -> dict[str, Any]:
    """What the form does not show but the node was onboarded with: where the
    agent lives, and a management address other than the SSH address."""
    if not last:
        return {}
    carried = {field: last[field] for field in CARRIED if last.get(field)}
    if last.get("mgmt_addr") and last.get("mgmt_addr") != last.get("addr"):
        carried["mgmt_addr"] = last["mgmt_addr"]
    return carried


def host_key_file(key_type: str) -> str:
    """Where the machine keeps the public half of a host key of this type."""
    return f"/etc/ssh/ssh_host_{HOST_KEY_FILES.get(key_type, 'ed25519')}_key.pub"
