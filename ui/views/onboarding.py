"""Onboarding from the web: "Add existing machine" on the Provisioning page
(two steps: read the host key the machine presents, then onboard once the
operator confirmed its fingerprint) and a node's "Re-onboard". Both create
the job through ``job_onboard_create``, as POST /api/v1/jobs/onboard/ and
``llmgw ctl onboard`` do."""

from __future__ import annotations

import asyncio
import logging
import time

import asyncssh
from django.conf import settings
from django.contrib import messages
from django.shortcuts import redirect, render

from core.exceptions import NotFound
from nodes import selectors as node_selectors
from provisioning import selectors as prov_selectors, sshkeys
from provisioning.choices import JobKind
from provisioning.onboard.request import job_onboard_create, onboard_request_check
from provisioning.validation import RequestInvalid

from ..onboard_form import (ONBOARD_FLAGS, ONBOARD_TEXT, REONBOARD_TEXT, form_read, host_key_file, onboard_request,
                            reonboard_carried, reonboard_prefill)
from .access import back, operation
from .provisioning import page_context

logger = logging.getLogger(__name__)

# Reading a host key is done while the operator waits: bounded.
HOST_KEY_TIMEOUT = 5.0
CONFIRM = ("compare it with the fingerprint the machine's console shows, then tick 'I compared it'")


def _unreachable(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return f"no SSH answer within {HOST_KEY_TIMEOUT:g} s"
    if isinstance(exc, asyncssh.Error):
        return exc.reason or type(exc).__name__
    return str(exc) or type(exc).__name__


def _page(request, form: dict, errors: dict, host_key: dict | None = None, status: int = 400):
    return render(request, "ui/provisioning.html",
                  page_context(add_form=form, add_errors=errors, host_key=host_key), status=status)


def _checked(request_: dict, errors: dict) -> dict:
    """Every field's problem at once: the form's own and the service's check."""
    try:
        onboard_request_check(request_)
    except RequestInvalid as exc:
        return {**exc.errors, **errors}
    return errors


def _read_host_key(request, form: dict):
    request_, errors = onboard_request(form)
    errors = _checked(request_, errors)
    if not form["addr"] or "addr" in errors or "ssh_port" in errors:
        errors.setdefault("addr", "required: the machine's address over SSH")
        return _page(request, form, errors)
    addr, port = request_["addr"], request_.get("ssh_port", 22)
    started = time.monotonic()
    try:
        key = sshkeys.host_key_fetch(addr, port, HOST_KEY_TIMEOUT)
    except (OSError, asyncssh.Error, asyncio.TimeoutError, ValueError) as exc:
        # One answer, at one time, for every failure: a closed port, a reset,
        # a silent host and a service that is not SSH look alike, so this
        # form is no port scanner. The cause is in the log.
        logger.info("host key not read addr=%s port=%s why=%s", addr, port, _unreachable(exc))
        time.sleep(max(0.0, started + HOST_KEY_TIMEOUT - time.monotonic()))
        errors["addr"] = (f"could not read the host key of {addr}:{port}: no SSH server answered there. "
                          "Check the address, the port and that sshd runs there; nothing was created.")
        return _page(request, form, errors)
    fingerprint = sshkeys.fingerprint(key)
    key_type = key.split()[0]
    given = form["host_key_fingerprint"]
    if given and given != fingerprint:
        errors["host_key_fingerprint"] = (
            f"{addr}:{port} presents {fingerprint}, not the {given} given here. If yours came from the machine's "
            "console, this address is not that machine (or someone is in between): do not onboard it.")
    else:
        form["host_key_fingerprint"] = fingerprint
    form["confirmed"] = False
    host_key = {"type": key_type, "fingerprint": fingerprint, "addr": addr, "port": port,
                "file": host_key_file(key_type)}
    return _page(request, form, errors, host_key, status=200)


def _onboard(request, form: dict):
    request_, errors = onboard_request(form)
    if not form["host_key_fingerprint"]:
        errors["host_key_fingerprint"] = ("required: press 'Read host key' and " + CONFIRM
                                          + ", or paste the fingerprint its console shows")
    elif not form["confirmed"]:
        errors["confirmed"] = "the host key is not confirmed: " + CONFIRM
    if errors:
        return _page(request, form, _checked(request_, errors))
    try:
        job = job_onboard_create(request=request_, user=request.user)
    except RequestInvalid as exc:
        return _page(request, form, dict(exc.errors))
    messages.success(request, f"Job {job.pk} queued: onboard {job.node_name}.")
    return redirect("ui-provisioning")


@operation("provisioning.run_provisioning")
def job_onboard(request):
    form = form_read(request.POST, ONBOARD_TEXT, ONBOARD_FLAGS)
    if request.POST.get("step") == "read-key":
        return _read_host_key(request, form)
    return _onboard(request, form)


def last_onboard_params(node_name: str) -> dict | None:
    job = prov_selectors.job_list(node=node_name, kind=JobKind.ONBOARD).order_by("-created_at", "-id").first()
    return None if job is None else job.params


def reonboard_context(node) -> dict:
    """The node page's Re-onboard card: its form's values and the host key
    the job will be pinned to when no fingerprint is given."""
    hcas = [(h.name, h.fabric.name if h.fabric else None) for h in node.hcas.all()]
    prefill = reonboard_prefill(last=last_onboard_params(node.name), mgmt_addr=node.mgmt_addr,
                                mgmt_interface=node.mgmt_interface, hcas=hcas, gpus=node.gpus.count(),
                                agent_server=settings.LLMGW_AGENT_SERVER)
    pinned = prov_selectors.node_host_key(node_name=node.name)
    return {"reonboard": prefill, "pinned_fingerprint": sshkeys.fingerprint(pinned) if pinned else ""}


@operation("provisioning.run_provisioning")
def node_reonboard(request, name: str):
    if node_selectors.node_get(name=name) is None:
        raise NotFound(f"no node named {name}")
    form = form_read(request.POST, REONBOARD_TEXT, ("skip_gpus",))
    request_, errors = onboard_request(form)
    request_ = {**reonboard_carried(last_onboard_params(name)), **request_, "node": name, "reinstall": True}
    if not request_.get("host_key_fingerprint") and not prov_selectors.node_host_key(node_name=name):
        errors["host_key_fingerprint"] = (
            f"no host key is pinned for {name} (no llmgw job has connected to it): read its fingerprint on its "
            "console (ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub) and give it")
    if errors:
        errors = _checked(request_, errors)
    else:
        try:
            job = job_onboard_create(request=request_, user=request.user)
        except RequestInvalid as exc:
            errors = dict(exc.errors)
        else:
            messages.success(request, f"Job {job.pk} queued: re-onboard {name} (reinstall); the Provisioning page "
                                      "shows its steps.")
            return back(request)
    problems = "; ".join(f"{field}: {message}" for field, message in errors.items())
    messages.error(request, f"{name} is not re-onboarded: {problems}. Nothing was started.")
    return back(request)
