"""Certificate rotation with a real agent and the real agent API: a node
certificate with a lifetime of seconds renews itself at two thirds of it, over
the current identity, without restarting the agent; the old serial is refused
afterwards; an expired certificate is refused with the way out."""

from __future__ import annotations

import datetime as dt
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from django.db.models import Q

from agent.identity import csr_make, key_ensure
from core.models import Event
from nodes import liveness
from nodes.models import Node
from pki.models import Certificate
from nodes.certificates import certs_warn_expiring
from pki.signing import cert_sign_node
from tests.conftest import REPO, mtls_client

from .conftest import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

LIFETIME = 30


def short_lived(config: Path, node_id: str, seconds: float) -> dict:
    """Give the node a fresh key of its own and a certificate of a few seconds."""
    tls = yaml.safe_load(config.read_text())["tls"]
    key = key_ensure(Path(tls["key"]), fresh=True)
    signed = cert_sign_node(node_id=node_id, csr_pem=csr_make(node_id=node_id, key=key),
                            lifetime=dt.timedelta(seconds=seconds))
    Path(tls["cert"]).write_bytes(signed.cert_pem)
    return {**tls, "serial": signed.row.serial}


def test_a_short_lived_certificate_renews_itself_and_the_old_serial_is_refused(
        agent_api_factory, sim_node, agent_factory, tmp_path):
    api = agent_api_factory(LLMGW_HEARTBEAT_INTERVAL="1", LLMGW_NODE_CERT_SECONDS=str(LIFETIME))
    config = sim_node("rot-node01", server=api.url)
    first = short_lived(config, "rot-node01", LIFETIME)
    old_cert, old_key = tmp_path / "old.pem", tmp_path / "old-key.pem"
    shutil.copy(first["cert"], old_cert)
    shutil.copy(first["key"], old_key)
    agent = agent_factory(config)
    pid = agent.proc.pid
    wait_until(lambda: Node.objects.filter(name="rot-node01").exists(), 30, interval=0.2, message="registered")

    log = agent.wait_for_log("certificate renewed: now serial", timeout=LIFETIME)
    old = Certificate.objects.get(serial=first["serial"])
    assert old.revoked_at is not None and old.revocation_reason.startswith("superseded by ")
    new_serial = old.revocation_reason.split()[-1]
    assert f"now serial {new_serial}" in log
    assert Event.objects.filter(subject="node/rot-node01", message__contains=f"superseded by {new_serial}").exists()

    # The old pair is refused at once (it has not expired: it was superseded):
    # by the view (403) until the worker re-reads its copy of the revoked
    # serials (every LLMGW_REVOCATION_CACHE_SECONDS), at the handshake after.
    try:
        with mtls_client(str(old_cert), str(old_key), first["ca"], timeout=10) as client:
            answer = client.post(f"{api.url}/agent/v1/nodes/rot-node01/heartbeat", json={})
    except httpx.TransportError:
        wait_until(lambda: f"revoked certificate cn=rot-node01 serial={first['serial']}" in api.log(), 10,
                   interval=0.2, message="the handshake refusal logged")
    else:
        assert answer.status_code == 403 and "revoked" in answer.json()["error"]
    # The agent goes on over its new identity, the same process.
    seen = liveness.store().seen("rot-node01")
    wait_until(lambda: (liveness.store().seen("rot-node01") or 0) > (seen or 0), 10, interval=0.2,
               message="heartbeats after renewal")
    assert agent.proc.pid == pid and agent.proc.poll() is None
    assert "refused this agent" not in agent.log()
    key_now = Path(first["key"])
    assert key_now.read_bytes() != old_key.read_bytes() and key_now.stat().st_mode & 0o777 == 0o600


def test_an_expired_certificate_is_refused_with_the_way_out(agent_api_factory, sim_node, tmp_path):
    api = agent_api_factory()
    config = sim_node("rot-node02", server=api.url)
    tls = short_lived(config, "rot-node02", 2)
    not_after = Certificate.objects.get(serial=tls["serial"]).not_after.timestamp()
    # Whole seconds in the certificate: one more, and no clock calls it valid.
    wait_until(lambda: time.time() > not_after + 1, 10, message="the certificate expired")
    check = subprocess.run([str(REPO / ".venv/bin/llmgw"), "agent", "--config", str(config), "--check"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 2
    assert "expired at" in check.stderr and "Re-onboard this node: llmgw ctl onboard" in check.stderr
    with pytest.raises(httpx.TransportError) as refused, \
            mtls_client(tls["cert"], tls["key"], tls["ca"], timeout=10) as client:
        client.post(f"{api.url}/agent/v1/nodes/rot-node02/heartbeat", json={})
    assert "certificate" in str(refused.value).lower() or isinstance(refused.value.__cause__, ssl.SSLError)


def test_a_week_before_expiry_an_event_warns_once_unless_a_newer_certificate_exists(pki_dir, tmp_path):
    key = key_ensure(tmp_path / "a.pem")
    soon = cert_sign_node(node_id="rot-node03", csr_pem=csr_make(node_id="rot-node03", key=key),
                          lifetime=dt.timedelta(days=3))
    assert certs_warn_expiring() == [soon.row.serial]
    assert certs_warn_expiring() == []
    [event] = Event.objects.filter(subject="node/rot-node03")
    assert event.severity == "warning" and "nothing has renewed it" in event.message
    other = key_ensure(tmp_path / "b.pem")
    cert_sign_node(node_id="rot-node04", csr_pem=csr_make(node_id="rot-node04", key=other),
                   lifetime=dt.timedelta(days=3))
    cert_sign_node(node_id="rot-node04", csr_pem=csr_make(node_id="rot-node04", key=key_ensure(tmp_path / "c.pem")),
                   lifetime=dt.timedelta(days=30))
    assert certs_warn_expiring() == []
    assert not Event.objects.filter(Q(subject="node/rot-node04")).exists()
