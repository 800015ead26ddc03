"""Onboarding from the web UI through Django's test client: Add existing
machine reading the host key of a real OpenSSH sshd and creating the job
only once its fingerprint is confirmed (the same job as POST
/api/v1/jobs/onboard/), New VM's "onboard it" (the same body as ``llmgw ctl
provision --onboard``), and a node's Re-onboard (its certificate states are
in test_certificates.py). No Celery worker: a job is queued and stays queued."""

from __future__ import annotations

import argparse
import re
import socket
import struct
import subprocess
import threading
import time
from html.parser import HTMLParser

import asyncssh
import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from core.models import Event
from provisioning import sshkeys
from provisioning.models import Job
from tests.conftest import free_port
from tests.provisioning.sshnode import SshNode, node_root

pytestmark = pytest.mark.django_db

HOST = "127.0.1.221"
FINGERPRINT = "SHA256:" + "Q" * 43


@pytest.fixture
def machine():
    """A real OpenSSH sshd on a loopback address, with its own ed25519 host key."""
    node = SshNode("onb-ui", HOST, free_port(HOST), node_root("llmgw-onb-ui-"), [])
    node.start()
    yield node
    node.remove()


def console_fingerprint(node: SshNode) -> str:
    """What the operator reads on the machine's console: ssh-keygen -lf on its host key."""
    out = subprocess.run(["ssh-keygen", "-lf", str(node.state / "ssh_host_ed25519_key.pub")], check=True,
                         capture_output=True, text=True).stdout
    return out.split()[1]


class _Form(HTMLParser):
    """The values a browser would submit from one form of a page."""

    def __init__(self, form_id: str):
        super().__init__()
        self.form_id, self.inside, self.values, self.textarea = form_id, False, {}, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "form" and (a.get("id") == self.form_id or self.form_id in (a.get("action") or "")):
            self.inside = True
        elif self.inside and tag == "input" and a.get("name") and a.get("type") != "submit":
            if a.get("type") == "checkbox":
                if "checked" in a:
                    self.values[a["name"]] = "on"
            else:
                self.values[a["name"]] = a.get("value") or ""
        elif self.inside and tag == "textarea":
            self.textarea = a["name"]
            self.values[self.textarea] = ""

    def handle_data(self, data):
        if self.textarea:
            self.values[self.textarea] += data

    def handle_endtag(self, tag):
        if tag == "textarea":
            self.textarea = None
        elif tag == "form":
            self.inside = False


def form_values(html: str, form_id: str) -> dict:
    parser = _Form(form_id)
    parser.feed(html)
    parser.values.pop("csrfmiddlewaretoken", None)
    return parser.values


def add_form(node: SshNode, **overrides) -> dict:
    form = {"node": "onb-ui", "addr": node.host, "ssh_port": str(node.port), "ssh_user": "root",
            "fabrics": "ib-a:mlx5_0,mlx5_1\nib-b", "mgmt_interface": "lo", "skip_gpus": "on"}
    form.update(overrides)
    return {k: v for k, v in form.items() if v is not None}


# --- Add existing machine ---------------------------------------------------------------


def test_read_host_key_shows_the_fingerprint_the_console_shows_and_creates_nothing(admin_client_ui, machine):
    response = admin_client_ui.post("/provisioning/onboard/", {**add_form(machine), "step": "read-key"})
    assert response.status_code == 200
    body = response.content.decode()
    fingerprint = console_fingerprint(machine)
    assert fingerprint == sshkeys.fingerprint(machine.host_key)
    assert f'id="host-key-read">{fingerprint}<' in body and "<strong>ssh-ed25519</strong>" in body
    assert "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub" in body
    assert form_values(body, "add-machine")["host_key_fingerprint"] == fingerprint
    assert "confirmed" not in form_values(body, "add-machine")  # never ticked for the operator
    assert form_values(body, "add-machine")["fabrics"] == "ib-a:mlx5_0,mlx5_1\nib-b"  # what was typed stays
    assert not Job.objects.exists()


def test_onboard_needs_the_fingerprint_confirmed_then_makes_the_same_job_as_the_rest_api(
        admin_client_ui, superuser, machine):
    read = admin_client_ui.post("/provisioning/onboard/", {**add_form(machine), "step": "read-key"})
    form = form_values(read.content.decode(), "add-machine")
    unconfirmed = admin_client_ui.post("/provisioning/onboard/", {**form, "step": "onboard"})
    assert unconfirmed.status_code == 400
    assert "<strong>confirmed</strong>: the host key is not confirmed" in unconfirmed.content.decode()
    no_key = admin_client_ui.post("/provisioning/onboard/", {**form, "host_key_fingerprint": "", "confirmed": "on",
                                                            "step": "onboard"})
    assert no_key.status_code == 400 and "<strong>host_key_fingerprint</strong>: required" in no_key.content.decode()
    assert not Job.objects.exists()

    done = admin_client_ui.post("/provisioning/onboard/", {**form, "confirmed": "on", "step": "onboard"}, follow=True)
    job = Job.objects.get()
    assert done.redirect_chain == [("/provisioning/", 302)]
    assert f"Job {job.pk} queued: onboard onb-ui." in done.content.decode()
    assert (job.kind, job.status, job.node_name, job.created_by) == ("onboard", "queued", "onb-ui", superuser)
    assert job.params["host_key_fingerprint"] == console_fingerprint(machine) and job.params["reinstall"] is False
    assert Event.objects.filter(subject=f"job/{job.pk}", message__contains="queued by root").exists()

    api = APIClient()
    api.force_authenticate(superuser)
    answer = api.post("/api/v1/jobs/onboard/", {
        "node": "onb-rest", "addr": machine.host, "ssh_port": machine.port, "ssh_user": "root",
        "fabrics": ["ib-a:mlx5_0,mlx5_1", "ib-b"], "mgmt_interface": "lo", "skip_gpus": True,
        "host_key_fingerprint": console_fingerprint(machine)}, format="json")
    assert answer.status_code == 201, answer.content
    rest = Job.objects.get(node_name="onb-rest")
    assert rest.params == job.params
    assert job.params["fabrics"] == [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]},
                                     {"name": "ib-b", "hcas": ["mlx5_0", "mlx5_1"]}]
    assert list(rest.steps.values_list("name", flat=True)) == list(job.steps.values_list("name", flat=True))


def test_a_pasted_fingerprint_skips_reading_the_key(admin_client_ui, small_cluster):
    response = admin_client_ui.post("/provisioning/onboard/", {
        "node": "onb-paste", "addr": "127.0.1.222", "host_key_fingerprint": FINGERPRINT, "confirmed": "on",
        "step": "onboard"})
    assert response.status_code == 302
    job = Job.objects.get(node_name="onb-paste")
    assert job.params["host_key_fingerprint"] == FINGERPRINT and job.params["ssh_user"] == "root"
    assert job.params["fabrics"] == [] and job.params["ssh_port"] == 22


def test_an_unreachable_machine_is_said_so_and_nothing_is_created(admin_client_ui):
    port = free_port("127.0.1.222")  # nothing listens there
    response = admin_client_ui.post("/provisioning/onboard/", {
        "node": "onb-gone", "addr": "127.0.1.222", "ssh_port": str(port), "step": "read-key"})
    assert response.status_code == 400
    body = response.content.decode()
    assert f"<strong>addr</strong>: could not read the host key of 127.0.1.222:{port}" in body
    assert "nothing was created" in body and 'id="host-key-read"' not in body
    assert not Job.objects.exists()


def test_a_machine_that_never_answers_is_given_up_on_within_the_bound(admin_client_ui, monkeypatch):
    from ui.views import onboarding

    monkeypatch.setattr(onboarding, "HOST_KEY_TIMEOUT", 0.5)
    with socket.socket() as silent:  # the kernel accepts the connection; nothing ever speaks SSH on it
        silent.bind(("127.0.1.222", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        started = time.monotonic()
        response = admin_client_ui.post("/provisioning/onboard/", {
            "node": "onb-mute", "addr": "127.0.1.222", "ssh_port": str(port), "step": "read-key"})
        waited = time.monotonic() - started
    assert response.status_code == 400 and waited < 5
    assert f"127.0.1.222:{port}: no SSH server answered there" in response.content.decode()
    assert not Job.objects.exists()


def _reset_server(sock: socket.socket) -> None:
    conn, _ = sock.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    conn.close()


def _http_server(sock: socket.socket) -> None:
    conn, _ = sock.accept()
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    conn.close()


def test_reading_a_host_key_is_no_port_scanner(admin_client_ui, monkeypatch):
    """A closed port, a reset, a silent listener and a service that is not
    SSH get the same answer, after the same time (issue 19, item 7)."""
    from ui.views import onboarding

    monkeypatch.setattr(onboarding, "HOST_KEY_TIMEOUT", 0.5)
    answers = {}
    for kind, serve in (("closed", None), ("reset", _reset_server), ("silent", lambda s: None),
                        ("http", _http_server)):
        with socket.socket() as sock:
            sock.bind(("127.0.1.222", 0))
            port = sock.getsockname()[1]
            if serve is None:
                sock.close()  # nothing listens there
            else:
                sock.listen(1)
                threading.Thread(target=serve, args=(sock,), daemon=True).start()
            started = time.monotonic()
            response = admin_client_ui.post("/provisioning/onboard/", {
                "node": "onb-scan", "addr": "127.0.1.222", "ssh_port": str(port), "step": "read-key"})
            waited = time.monotonic() - started
        assert response.status_code == 400 and 0.5 <= waited < 5, (kind, waited)
        body = response.content.decode()
        answers[kind] = re.search(r"<strong>addr</strong>: [^<]*", body)[0].replace(str(port), "PORT")
    assert len(set(answers.values())) == 1, answers
    assert not Job.objects.exists()


def test_a_fingerprint_other_than_the_machines_is_refused(admin_client_ui, machine):
    response = admin_client_ui.post("/provisioning/onboard/", {
        **add_form(machine), "host_key_fingerprint": FINGERPRINT, "step": "read-key"})
    body = response.content.decode()
    assert f"presents {console_fingerprint(machine)}, not the {FINGERPRINT} given here" in body
    assert form_values(body, "add-machine")["host_key_fingerprint"] == FINGERPRINT  # the operator's, kept
    assert not Job.objects.exists()


def test_bad_fields_are_named_and_nothing_is_created(admin_client_ui, small_cluster):
    response = admin_client_ui.post("/provisioning/onboard/", {
        "node": "Bad_Name!", "addr": "not an address", "ssh_port": "twenty-two", "fabrics": "ib/a:mlx5_0",
        "ssh_user": "Root User", "host_key_fingerprint": "SHA256:short", "confirmed": "on", "step": "onboard"})
    assert response.status_code == 400
    body = response.content.decode()
    for field in ("node", "addr", "ssh_port", "ssh_user", "fabrics", "host_key_fingerprint"):
        assert f"<strong>{field}</strong>: " in body, field
    assert "give the SSH port as a whole number" in body and 'aria-invalid="true"' in body
    known = admin_client_ui.post("/provisioning/onboard/", {
        "node": "node01", "addr": "127.0.1.1", "host_key_fingerprint": FINGERPRINT, "confirmed": "on",
        "step": "onboard"})
    assert known.status_code == 400 and "onboard it again only with reinstall" in known.content.decode()
    assert not Job.objects.exists()
    again = admin_client_ui.post("/provisioning/onboard/", {
        "node": "node01", "addr": "127.0.1.1", "host_key_fingerprint": FINGERPRINT, "confirmed": "on",
        "reinstall": "on", "step": "onboard"})
    assert again.status_code == 302 and Job.objects.get(node_name="node01").params["reinstall"] is True


@pytest.fixture
def operator_client(client, db):
    from accounts import roles
    from accounts.services import user_create

    user, _ = user_create(actor="tests", username="op", role=roles.OPERATOR, password="op-password-for-tests")
    client.force_login(user)
    return client


@pytest.mark.parametrize("who", ["viewer_client", "operator_client"])
def test_viewers_and_operators_see_no_onboarding_form_and_are_refused(request, small_cluster, who):
    client = request.getfixturevalue(who)
    assert 'id="add-machine"' not in client.get("/provisioning/").content.decode()
    page = client.get("/nodes/node01/").content.decode()
    assert 'id="reonboard"' not in page and "/reonboard/" not in page
    for path, data in (("/provisioning/onboard/", {"node": "n9", "addr": "127.0.1.9", "step": "read-key"}),
                       ("/provisioning/onboard/", {"node": "n9", "addr": "127.0.1.9", "confirmed": "on",
                                                   "host_key_fingerprint": FINGERPRINT, "step": "onboard"}),
                       ("/nodes/node01/reonboard/", {"addr": "127.0.1.1", "host_key_fingerprint": FINGERPRINT})):
        assert client.post(path, data).status_code == 403, (who, path)
    assert not Job.objects.exists()


# --- New VM, onboarded when it is made ----------------------------------------------------


@pytest.fixture
def hypervisor(db):
    from provisioning.models import Hypervisor

    return Hypervisor.objects.create(name="pve1", url="https://127.0.0.1:8006", token_id="u@pve!t",
                                     token_secret_encrypted="x", image="local:import/noble.qcow2")


VM = {"node": "node09", "hypervisor": "pve1", "vmid": "144", "ip": "10.0.0.144/24", "gateway": "10.0.0.1",
      "cores": "16", "memory": "65536", "disk": "200G"}


def cli_onboard_body(*argv: str) -> dict:
    """What ``llmgw ctl provision ... --onboard`` puts under "onboard", from the CLI's own parser."""
    from cli.ctl import provisioning as ctl_provisioning

    parser = argparse.ArgumentParser()
    ctl_provisioning.register(parser.add_subparsers())
    args = parser.parse_args(["provision", "node09", "--vmid", "144", "--ip", "10.0.0.144/24", "--gateway",
                              "10.0.0.1", "--onboard", *argv])
    return ctl_provisioning.onboard_body(args)


def test_new_vm_onboarded_when_made_carries_the_clis_onboard_body(admin_client_ui, hypervisor):
    body = admin_client_ui.get("/provisioning/").content.decode()
    assert "Onboard it when it is made" in body
    response = admin_client_ui.post("/provisioning/vm/", {
        **VM, "onboard": "on", "ob_ssh_user": "ubuntu", "ob_fabrics": "ib-a:mlx5_0,mlx5_1 ib-b",
        "ob_mgmt_interface": "ens18", "ob_skip_gpus": "on"}, follow=True)
    job = Job.objects.get(node_name="node09")
    assert f"Job {job.pk} queued: provision node09; onboarding follows" in response.content.decode()
    assert job.params["onboard"] == cli_onboard_body(
        "--ssh-user", "ubuntu", "--fabric", "ib-a:mlx5_0,mlx5_1", "--fabric", "ib-b", "--mgmt-interface", "ens18",
        "--skip-gpus")
    assert job.params["onboard"] == {"fabrics": ["ib-a:mlx5_0,mlx5_1", "ib-b"], "skip_gpus": True,
                                     "ssh_user": "ubuntu", "mgmt_interface": "ens18"}


def test_new_vm_onboard_defaults_and_without_it(admin_client_ui, hypervisor):
    admin_client_ui.post("/provisioning/vm/", {**VM, "onboard": "on"})
    assert Job.objects.get(node_name="node09").params["onboard"] == cli_onboard_body()
    Job.objects.all().delete()
    admin_client_ui.post("/provisioning/vm/", VM)
    assert "onboard" not in Job.objects.get(node_name="node09").params


def test_new_vm_onboarding_fields_are_checked_before_any_vm_is_made(admin_client_ui, hypervisor):
    bad = admin_client_ui.post("/provisioning/vm/", {**VM, "onboard": "on", "ob_fabrics": "ib/a",
                                                     "ob_ssh_user": "Not A User"})
    assert bad.status_code == 400
    body = bad.content.decode()
    assert "<strong>fabrics</strong>: " in body and "<strong>ssh_user</strong>: " in body
    assert form_values(body, "new-vm")["onboard"] == "on"
    unticked = admin_client_ui.post("/provisioning/vm/", {**VM, "ob_fabrics": "ib-a"})
    assert unticked.status_code == 400
    assert "<strong>onboard</strong>: the onboarding fields are filled in" in unticked.content.decode()
    assert not Job.objects.exists()


# --- Re-onboard from the node page --------------------------------------------------------


def test_reonboard_a_node_llmgw_never_connected_to_needs_a_fingerprint(admin_client_ui, small_cluster):
    page = admin_client_ui.get("/nodes/node01/").content.decode()
    assert "Re-onboard node01" in page and "none is pinned" in page
    form = form_values(page, "/nodes/node01/reonboard/")
    assert (form["addr"], form["fabrics"], form["ssh_user"], form["ssh_port"]) == (
        "127.0.1.1", "ib-a:mlx5_0,mlx5_1", "root", "22")
    assert "skip_gpus" not in form  # it has GPUs
    refused = admin_client_ui.post("/nodes/node01/reonboard/", form, HTTP_REFERER="http://testserver/nodes/node01/",
                                   follow=True)
    assert refused.redirect_chain == [("http://testserver/nodes/node01/", 302)]
    assert "node01 is not re-onboarded: host_key_fingerprint: no host key is pinned" in refused.content.decode()
    assert not Job.objects.exists()

    done = admin_client_ui.post("/nodes/node01/reonboard/", {**form, "host_key_fingerprint": FINGERPRINT}, follow=True)
    job = Job.objects.get(node_name="node01")
    assert f"Job {job.pk} queued: re-onboard node01 (reinstall)" in done.content.decode()
    assert (job.kind, job.params["reinstall"], job.params["addr"], job.params["host_key_fingerprint"]) == (
        "onboard", True, "127.0.1.1", FINGERPRINT)
    assert job.params["fabrics"] == [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]}]


@pytest.fixture
def onboarded_node02(small_cluster):
    """node02 as an earlier onboarding job left it: non-default params, the host key it pinned."""
    from provisioning.onboard.request import onboard_request_check

    params = onboard_request_check({
        "node": "node02", "addr": "10.9.0.2", "ssh_port": 2222, "ssh_user": "ubuntu",
        "fabrics": ["ib-a:mlx5_2,mlx5_3"], "mgmt_interface": "ens18", "mgmt_addr": "10.8.0.2",
        "nvidia_smi": "/opt/nv/nvidia-smi", "agent_server": "https://cp.example:7443", "root": "/srv/node02"})
    params.pop("node")
    key = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    return Job.objects.create(kind="onboard", node_name="node02", status="succeeded", params=params,
                              status_changed_at=timezone.now(), ssh_host_key=key)


def test_reonboard_is_prefilled_from_the_last_onboarding_and_repeats_it_with_reinstall(
        admin_client_ui, onboarded_node02):
    page = admin_client_ui.get("/nodes/node02/").content.decode()
    assert sshkeys.fingerprint(onboarded_node02.ssh_host_key) in page
    form = form_values(page, "/nodes/node02/reonboard/")
    assert form == {"addr": "10.9.0.2", "ssh_port": "2222", "ssh_user": "ubuntu", "fabrics": "ib-a:mlx5_2,mlx5_3",
                    "mgmt_interface": "ens18", "nvidia_smi": "/opt/nv/nvidia-smi",
                    "ib_root": "/sys/class/infiniband", "agent_server": "https://cp.example:7443",
                    "host_key_fingerprint": ""}
    response = admin_client_ui.post("/nodes/node02/reonboard/", form)
    assert response.status_code == 302
    job = Job.objects.filter(node_name="node02").latest("pk")
    assert job.pk != onboarded_node02.pk and job.status == "queued"
    # Everything as before (the install root, the management address too), now with reinstall.
    assert job.params == {**onboarded_node02.params, "reinstall": True}
    assert Event.objects.filter(subject=f"job/{job.pk}", message__contains="onboard node02 at 10.9.0.2").exists()


def test_a_refused_reonboard_is_a_message_on_the_node_page(admin_client_ui, onboarded_node02):
    form = form_values(admin_client_ui.get("/nodes/node02/").content.decode(), "/nodes/node02/reonboard/")
    bad = admin_client_ui.post("/nodes/node02/reonboard/", {**form, "ssh_port": "x", "fabrics": "ib/a"},
                               HTTP_REFERER="http://testserver/nodes/node02/", follow=True)
    assert bad.status_code == 200
    text = bad.content.decode()
    assert "node02 is not re-onboarded: " in text and "ssh_port: &#x27;x&#x27;: give the SSH port" in text
    assert "fabrics: &#x27;ib/a&#x27;" in text and "Nothing was started." in text
    assert Job.objects.filter(node_name="node02").count() == 1
    Job.objects.filter(pk=onboarded_node02.pk).update(status="running")
    busy = admin_client_ui.post("/nodes/node02/reonboard/", form, follow=True).content.decode()
    assert "a job for node02 is already running" in busy
    gone = admin_client_ui.post("/nodes/nope/reonboard/", form, follow=True)
    assert gone.status_code == 200 and "no node named nope" in gone.content.decode()
