"""The onboarding job, second half: the node's certificate, agent.yaml, the
unit, and the first heartbeat (install.py: the first half; steps.py: the list).

No database work happens inside an SSH session's coroutine (the ORM is
synchronous): a step reads the node, decides here, then writes to the node.
"""

from __future__ import annotations

import re
import time
import yaml
from cryptography import x509
from django.conf import settings
from django.utils import timezone

from nodes import selectors as node_selectors
from nodes.models import Node
from pki.models import Certificate
from pki.choices import CertificateKind
from pki.services import CA_CERT, PkiError, cert_revoke, pki_dir
from pki.signing import cert_sign_node, csr_load

from .. import nodessh
from ..exceptions import StepFailed
from ..stepkit import Done, Skipped, StepContext, Wait
from .install import UNIT, UNIT_TEMPLATE, _must, _ssh, paths, q

# How long the heartbeat step first waits in place for the node (seconds).
FIRST_LOOK = 5.0
TRUST = (
    "if command -v update-ca-certificates >/dev/null 2>&1; then d={root}/usr/local/share/ca-certificates; "
    "mkdir -p $d && cp {ca} $d/llmgw-ca.crt && update-ca-certificates >/dev/null 2>&1 && echo update-ca-certificates; "
    "elif command -v update-ca-trust >/dev/null 2>&1; then d={root}/etc/pki/ca-trust/source/anchors; "
    "mkdir -p $d && cp {ca} $d/llmgw-ca.pem && update-ca-trust extract && echo update-ca-trust; "
    "else echo none; fi"
)
# What the agent logs when the control plane says no (agent/client.py).
REFUSAL_RE = re.compile(r"control plane (refused this agent|rejected the heartbeat).*")


def _live_serial(cert_pem: str) -> str | None:
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
    except ValueError:
        return None
    serial = format(cert.serial_number, "x")
    live = Certificate.objects.filter(serial=serial, revoked_at=None, not_after__gt=timezone.now()).exists()
    return serial if live else None


def _same_key(cert_pem: str, csr) -> bool:
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    return cert.public_key().public_numbers() == csr.public_key().public_numbers()


def _supersede_others(job, serial: str) -> list[str]:
    """The node's other live certificates (an earlier install's key: a
    reinstalled machine, a re-onboarded node) are refused from now on. Run
    after the node holds its new certificate, on every run of the step, so a
    job killed in between still ends with only one."""
    others = (Certificate.objects.filter(common_name=job.node_name, kind=CertificateKind.CLIENT, revoked_at=None)
              .exclude(serial=serial).values_list("serial", flat=True))
    who = f"user {job.created_by.get_username()}" if job.created_by else f"onboarding job {job.pk}"
    done = []
    for other in others:
        try:
            cert_revoke(target=other, reason=f"superseded by {serial} (onboarding job {job.pk})", actor=who)
        except PkiError:
            continue  # revoked meanwhile
        done.append(other)
    return done


def certificate(ctx: StepContext):
    node, p = ctx.job.node_name, paths(ctx.job)
    ca_pem = (pki_dir() / CA_CERT).read_text()

    async def read(s: nodessh.Session):
        got = await s.run(f"mkdir -p {q(str(p.etc))} && {q(str(p.agent))} csr --node {q(node)} --key {q(str(p.key))} "
                          f"&& echo '#cert' && {{ cat {q(str(p.cert))} 2>/dev/null; echo '#ca'; "
                          f"cat {q(str(p.ca))} 2>/dev/null; true; }}")
        return _must(got, "making the node's key and certificate request (llmgw-agent csr)")
    got = _ssh(ctx, read)
    if isinstance(got, Wait):
        return got
    csr_text, _, held = got.partition("#cert")
    cert_text, _, ca_text = (part.strip() for part in held.partition("#ca"))
    try:
        csr = csr_load(csr_text)
    except PkiError as exc:
        raise StepFailed(f"the node's certificate request: {exc}") from None
    serial = _live_serial(cert_text) if cert_text else None
    if serial and ca_text == ca_pem.strip() and _same_key(cert_text, csr):
        cert_pem, what = None, "held"
    else:
        try:
            signed = cert_sign_node(node_id=node, csr_pem=csr_text)
        except PkiError as exc:
            raise StepFailed(f"the control plane will not sign the node's request: {exc}") from None
        cert_pem, serial = signed.cert_pem.decode(), signed.row.serial
        what = "signed" if signed.new else "signed earlier for this key, sent again"

    async def write(s: nodessh.Session):
        writes = "" if cert_pem is None else (
            f"{{ {nodessh.write_command(str(p.cert), cert_pem)} && {nodessh.write_command(str(p.ca), ca_pem)} "
            "|| { echo 'writing the certificate and the CA root failed' >&2; exit 1; }; } && ")
        return _must(await s.run(writes + TRUST.format(root=q(str(p.root)), ca=q(str(p.ca)))),
                     "writing the certificate and trusting the CA root system-wide").strip()
    trust = _ssh(ctx, write)
    if isinstance(trust, Wait):
        return trust
    trusted = "no system trust tool on the node" if trust == "none" else f"root trusted system-wide ({trust})"
    superseded = _supersede_others(ctx.job, serial)
    if superseded:
        trusted += f"; the node's earlier certificate(s) {', '.join(superseded)} superseded"
    if what == "held":
        return Skipped(f"the node's key already holds live certificate {serial}; {trusted}")
    return Done(f"key made on the node ({p.key}, 0600, never sent); certificate {serial} {what}; {trusted}")


def agent_config(job) -> dict:
    params, p = job.params, paths(job)
    return {
        "node_id": job.node_name,
        "server": params["server"],
        "tls": {"ca": str(p.ca), "cert": str(p.cert), "key": str(p.key)},
        "mgmt_addr": params["mgmt_addr"],
        "mgmt_interface": params["mgmt_interface"],
        "fabrics": [{"name": f["name"], "hcas": list(f["hcas"])} for f in params["fabrics"]],
        "discovery": {"nvidia_smi": params["nvidia_smi"], "ib_root": params["ib_root"],
                      "skip_gpus": params["skip_gpus"]},
        "supervisor": {"work_dir": str(p.work_dir)},
        "engine_user": params.get("engine_user") or settings.LLMGW_ENGINE_USER,
    }


def engine_user_command(user: str) -> str:
    """Create the engines' user where it is missing (a system user, no login,
    no home), in those of the groups that usually own GPU and RDMA devices
    that the node has. A user that exists is left as its admin made it; the
    agent adds whatever groups own the device files when it starts an engine."""
    u = q(user)
    return (f"if ! getent passwd {u} >/dev/null; then g=$(for g in video render rdma; do "
            "getent group $g >/dev/null && printf %s, $g; done); "
            'useradd --system --user-group ${g:+--groups "${g%,}"} --no-create-home --home-dir /nonexistent '
            f"--shell /usr/sbin/nologin {u} || exit 91; fi")


def configure(ctx: StepContext):
    p = paths(ctx.job)
    text = (f"# Written by llmgw onboarding job {ctx.job.pk}; 'llmgw ctl onboard {ctx.job.node_name} --reinstall' "
            "writes it again.\n" + yaml.safe_dump(agent_config(ctx.job), sort_keys=False))

    user = agent_config(ctx.job)["engine_user"]

    async def body(s: nodessh.Session):
        return await s.run(
            f"{engine_user_command(user)}; "
            f"{nodessh.write_command(str(p.config), text)} || {{ echo 'writing agent.yaml failed' >&2; exit 90; }}; "
            f"mkdir -p {q(str(p.work_dir))} || exit 90; "
            f"{q(str(p.agent))} check-config --config {q(str(p.config))}")
    got = _ssh(ctx, body)
    if isinstance(got, Wait):
        return got
    if got.rc == 90:
        raise StepFailed(f"writing agent.yaml and its work directory failed: {got.text()}")
    if got.rc == 91:
        raise StepFailed(f"creating the engines' user {user} failed: {got.text()}")
    if got.rc != 0:
        raise StepFailed(f"the agent refuses its configuration: {got.text()}")
    return Done(f"{p.config} written and checked by the agent; engines run as {user}")


def systemd_quote(word: str) -> str:
    """One word of a unit's command line: double-quoted, with systemd's
    specifiers (%) and variables ($) escaped, so a path is only a path."""
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def unit_text(job) -> str:
    p = paths(job)
    user = agent_config(job)["engine_user"]
    text = UNIT_TEMPLATE.read_text()
    command = " ".join(systemd_quote(w) for w in (str(p.agent), "run", "--config", str(p.config)))
    text = re.sub(r"^ExecStart=.*$", lambda _: f"ExecStart={command}", text, flags=re.M)
    text = text.replace("llmgw-engine", user)  # the ExecStartPre that creates it (a checked user name)
    return text


def start(ctx: StepContext):
    p, reinstall = paths(ctx.job), ctx.job.params["reinstall"]
    text = unit_text(ctx.job)

    async def body(s: nodessh.Session):
        state = await s.run(f"systemctl is-active {UNIT}; echo '#unit'; cat {q(str(p.unit))} 2>/dev/null; true")
        active, _, held = state.out.partition("#unit\n")
        active = active.strip()
        if held == text and active == "active" and not reinstall:
            return None
        restart = f" && systemctl restart {UNIT}" if reinstall or active == "active" else ""
        return _must(await s.run(f"{nodessh.write_command(str(p.unit), text)} && systemctl daemon-reload && "
                                 f"systemctl enable --now {UNIT}{restart}"),
                     "installing the unit and systemctl enable --now")
    got = _ssh(ctx, body)
    if isinstance(got, Wait):
        return got
    if got is None:
        return Skipped(f"{UNIT} is installed and active")
    return Done(f"{p.unit} installed; {UNIT} enabled and started")


def _inventory(node: Node) -> dict:
    return {
        "gpus": [{"index": g.index, "name": g.name, "uuid": g.uuid} for g in node.gpus.order_by("index")],
        "hcas": [{"name": h.name, "fabric": h.fabric.name if h.fabric else None, "state": h.state}
                 for h in node.hcas.select_related("fabric").order_by("name")],
        "fabrics": sorted(node.fabrics.values_list("name", flat=True)),
        "status": node.status,
    }


def _heard_since(node: Node, since) -> bool:
    """Registered or heartbeated since then (heartbeats land in the liveness
    store; the row's copy is written only now and then)."""
    if node.registered_at and node.registered_at >= since:
        return True
    seen = node_selectors.node_seen(node)
    return seen is not None and seen >= since


def _heard(node_name: str, since, seconds: float) -> Node | None:
    """The node, once heard since then; None if not within the seconds."""
    deadline = time.monotonic() + seconds
    while True:
        node = Node.objects.filter(name=node_name).first()
        if node is not None and _heard_since(node, since):
            return node
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.25)


def first_heartbeat(ctx: StepContext):
    # Heard since the unit was started; on a reinstall, since it was
    # restarted: the agent before heartbeated too, and only the restarted one
    # proves the job worked.
    start = ctx.job.steps.get(name="start")
    since = (start.finished_at if ctx.job.params["reinstall"] else start.started_at) or ctx.job.created_at
    # The first heartbeat usually comes a second or two after the start: on
    # the step's first visit it is awaited here for a few seconds (a cheap
    # read, no SSH) rather than behind every other queued job's steps.
    node = _heard(ctx.job.node_name, since, 0 if ctx.data.get("waited") else FIRST_LOOK)
    if node is not None:
        inventory = _inventory(node)
        ctx.data["inventory"] = inventory
        hcas = ", ".join(f"{h['name']} ({h['fabric'] or 'no fabric'})" for h in inventory["hcas"]) or "no HCAs"
        gpus = inventory["gpus"]
        return Done(f"{node.name} heartbeats ({node.status}): {len(gpus)} GPU(s)"
                    + (f" {gpus[0]['name']}" if gpus else "") + f"; {hcas}; fabrics "
                    + (", ".join(inventory["fabrics"]) or "none (island)"))

    async def body(s: nodessh.Session):
        got = await s.run(f"systemctl is-active {UNIT}; echo '#log'; journalctl -u {UNIT} -n 40 --no-pager -o cat 2>&1; true")
        active, _, log = got.out.partition("#log\n")
        return active.strip(), log
    got = _ssh(ctx, body)
    if isinstance(got, Wait):
        return got
    active, log = got
    refusals = [m.group(0) for m in REFUSAL_RE.finditer(log)]
    if refusals:
        raise StepFailed(f"the control plane refuses the node: {refusals[-1]}")
    left = ctx.deadline("heartbeat_until", settings.LLMGW_ONBOARD_HEARTBEAT_DEADLINE)
    if active not in ("active", "activating") or left <= 0:
        tail = " | ".join(log.strip().splitlines()[-5:])
        why = f"the agent is {active or 'not running'}" if left > 0 else (
            f"no heartbeat within {settings.LLMGW_ONBOARD_HEARTBEAT_DEADLINE:.0f}s")
        raise StepFailed(f"{why}; its log: {tail or '(empty)'}")
    note = "" if ctx.data.get("waited") else f"{UNIT} is {active}; waiting for the first heartbeat"
    ctx.data["waited"] = True
    return Wait(ctx.backoff("poll", start=settings.LLMGW_PROVISION_POLL_MIN, ceiling=settings.LLMGW_PROVISION_POLL_MAX),
                note)

