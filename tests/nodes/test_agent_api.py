"""The agent API over real mTLS: who gets in, what is refused, what is stored.

Every test talks to a real gunicorn listener (``agent_api``) with real
certificates; refusals are checked both on the wire and in the database
(nothing stored) and, where the design asks for it, in the server's log.
"""

from __future__ import annotations

import datetime as dt
import json
import socket
import ssl
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.protocol import HeartbeatReply, example_heartbeat
from cli.wait import wait_until
from core.models import Event
from nodes import liveness
from nodes.choices import NodeEventKind, NodeStatus
from nodes.models import Fabric, Gpu, Hca, Node
from pki import services as pki_services
from pki.models import Certificate
from tests.conftest import mtls_client, mtls_context

pytestmark = pytest.mark.django_db(transaction=True)


# --- helpers ------------------------------------------------------------------------


def heartbeat_url(server, node_id: str) -> str:
    return f"{server.url}/agent/v1/nodes/{node_id}/heartbeat"


def payload(**changes) -> dict:
    data = example_heartbeat().to_dict()
    data.update(changes)
    return data


def post(server, creds, node_id: str, body=None, *, content: bytes | None = None, **kwargs) -> httpx.Response:
    with mtls_client(*creds, timeout=10) as client:
        if content is not None:
            return client.post(heartbeat_url(server, node_id), content=content, **kwargs)
        return client.post(heartbeat_url(server, node_id), json=payload() if body is None else body, **kwargs)


def snapshot() -> dict:
    """Everything a heartbeat can write, in comparable form."""
    return {
        "nodes": list(
            Node.objects.order_by("name").values_list(
                "name", "status", "inventory_hash", "mgmt_addr", "agent_version", "discovery_errors", "engines"
            )
        ),
        "gpus": list(Gpu.objects.order_by("uuid").values_list("node__name", "index", "uuid", "memory_mib")),
        "hcas": list(Hca.objects.order_by("node__name", "name").values_list("node__name", "name", "fabric__name")),
        "fabrics": list(Fabric.objects.order_by("name").values_list("name", flat=True)),
        "events": Event.objects.count(),
    }


def wait_for_log(server, *needles: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = server.log()
        if all(n in log for n in needles):
            return log
        if time.monotonic() > deadline:
            raise AssertionError(f"server log lacks {needles}:\n{log[-3000:]}")
        time.sleep(0.05)


def tls_refusal(server, context: ssl.SSLContext) -> str:
    """Connect and handshake; return how TLS refused us.

    With TLS 1.3 the client's side of the handshake completes before the
    server has judged the client's certificate: the refusal arrives as an
    alert on the first read. Nothing is sent first, so that the server closes
    with nothing unread and the alert is not lost to a TCP reset. A server
    that accepts the handshake waits for a request: that is a failure here.
    """
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                data = tls.recv(65536)
        except ssl.SSLError as exc:
            return exc.reason or str(exc)
        except TimeoutError:
            pytest.fail("the server accepted the handshake and waited for a request")
    pytest.fail(f"the server closed without a TLS alert ({data!r})")


def other_authority_bundle(tmp_path, node_id: str, ca_name: str) -> tuple[str, str, str]:
    """A client certificate for ``node_id`` from an authority that is not ours."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=10))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=10))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out = tmp_path / "other-ca"
    out.mkdir()
    paths = (out / f"{node_id}.pem", out / f"{node_id}-key.pem", out / "ca.pem")
    paths[0].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths[2].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return tuple(str(p) for p in paths)


def client_context(cert: str | None, key: str | None, ca: str) -> ssl.SSLContext:
    """A context that trusts our server, presenting ``cert`` (or nothing)."""
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    return context


# --- the TLS layer refuses ----------------------------------------------------------


def test_no_client_certificate_fails_the_handshake(agent_api, client_cert):
    _, _, ca = client_cert("node01")
    before = snapshot()
    reason = tls_refusal(agent_api, client_context(None, None, ca))
    assert reason in {"TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_HANDSHAKE_FAILURE"}, reason
    with httpx.Client(verify=client_context(None, None, ca), timeout=10) as client:
        with pytest.raises(httpx.TransportError):
            client.post(heartbeat_url(agent_api, "node01"), json=payload())
    wait_for_log(agent_api, "tls handshake refused")
    assert snapshot() == before


@pytest.mark.parametrize(
    ("ca_name", "alert"),
    [
        ("some other CA", "TLSV1_ALERT_UNKNOWN_CA"),
        # An impostor naming its authority like ours: the signature does not verify.
        ("llmgw test CA", "TLSV1_ALERT_DECRYPT_ERROR"),
    ],
)
def test_certificate_from_another_authority_fails_the_handshake(agent_api, client_cert, tmp_path, ca_name, alert):
    _, _, our_ca = client_cert("node01")
    cert, key, _ = other_authority_bundle(tmp_path, "node01", ca_name)
    before = snapshot()
    reason = tls_refusal(agent_api, client_context(cert, key, our_ca))
    assert reason == alert
    with pytest.raises(httpx.TransportError):
        post(agent_api, (cert, key, our_ca), "node01")
    wait_for_log(agent_api, "tls handshake refused")
    assert snapshot() == before
    assert not Node.objects.filter(name="node01").exists()


def test_expired_certificate_fails_the_handshake(agent_api, client_cert):
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3)
    cert, key, ca = client_cert("node01", not_before=past, days=1)
    before = snapshot()
    reason = tls_refusal(agent_api, client_context(cert, key, ca))
    assert reason == "SSLV3_ALERT_CERTIFICATE_EXPIRED", reason
    with pytest.raises(httpx.TransportError):
        post(agent_api, (cert, key, ca), "node01")
    wait_for_log(agent_api, "tls handshake refused")
    assert snapshot() == before


def test_server_certificate_cannot_be_used_as_a_client_certificate(agent_api, client_cert, tmp_path):
    """OpenSSL enforces the clientAuth usage: a serverAuth-only certificate is not a node."""
    _, _, ca = client_cert("node01")
    issued = pki_services.cert_issue_server(hosts=["node01"], ips=[])
    (tmp_path / "srv.pem").write_bytes(issued.cert_pem)
    (tmp_path / "srv-key.pem").write_bytes(issued.key_pem)
    before = snapshot()
    reason = tls_refusal(agent_api, client_context(str(tmp_path / "srv.pem"), str(tmp_path / "srv-key.pem"), ca))
    assert reason in {"SSLV3_ALERT_UNSUPPORTED_CERTIFICATE", "SSLV3_ALERT_BAD_CERTIFICATE"}, reason
    assert snapshot() == before


# --- the agent API refuses ----------------------------------------------------------


def test_certificate_of_another_node_is_refused_and_logged(agent_api, client_cert):
    node01 = client_cert("node01")
    assert post(agent_api, node01, "node01").status_code == 200
    node02 = client_cert("node02")
    serial02 = Certificate.objects.get(common_name="node02").serial
    before = snapshot()

    r = post(agent_api, node02, "node01", payload(gpus=[]))
    assert r.status_code == 403, r.text
    message = r.json()["error"]
    assert "'node02'" in message and "'node01'" in message
    log = wait_for_log(agent_api, "cn=node02", "node=node01")
    line = next(line for line in log.splitlines() if "cn=node02" in line and "node=node01" in line)
    assert "refused" in line and serial02 in line
    assert snapshot() == before
    assert Node.objects.get(name="node01").gpus.count() == 8
    assert not Node.objects.filter(name="node02").exists()


def test_revoked_certificate_is_refused_once_the_cache_expires(agent_api, client_cert):
    creds = client_cert("node01")
    with mtls_client(*creds, timeout=10) as client:
        assert client.post(heartbeat_url(agent_api, "node01"), json=payload()).status_code == 200
        pki_services.cert_revoke(target="node01", reason="test")
        # Same inventory as stored: nothing to write even while the listener
        # still trusts its cached revocation list. Over the same keep-alive
        # connection: revocation is checked per request, not per handshake.

        def refused():
            r = client.post(heartbeat_url(agent_api, "node01"), json=payload())
            assert r.status_code in (200, 403), r.text
            return r if r.status_code == 403 else None

        r = wait_until(refused, timeout=30, message="the revoked certificate refused")
        assert "has been revoked" in r.json()["error"]
        before = snapshot()
        r = client.post(heartbeat_url(agent_api, "node01"), json=payload(gpus=[], agent_version="9.9"))
        assert r.status_code == 403
    assert snapshot() == before
    assert Node.objects.get(name="node01").gpus.count() == 8
    wait_for_log(agent_api, "revoked certificate cn=node01")


def test_a_new_certificate_for_a_revoked_node_is_accepted(agent_api, client_cert):
    old = client_cert("node01")
    pki_services.cert_revoke(target="node01")
    # Once the listener's copy of the revoked serials (LLMGW_REVOCATION_CACHE_SECONDS)
    # is fresh, a new connection with the revoked certificate is closed right
    # after its handshake, unanswered (tests/agentapi/test_slow_clients.py).

    def refused_at_handshake() -> bool:
        try:
            post(agent_api, old, "node01")
        except httpx.TransportError:
            return True
        return False

    # (Until the listener's copy is fresh, up to LLMGW_REVOCATION_CACHE_SECONDS,
    # the revoked certificate may still be heard: that window is documented.)
    wait_until(refused_at_handshake, timeout=30, message="the revoked certificate refused after its handshake")
    assert post(agent_api, client_cert("node01"), "node01").status_code == 200


def _dup_index():
    data = payload()
    data["gpus"][1]["index"] = data["gpus"][0]["index"]
    return data


def _dup_uuid():
    data = payload()
    data["gpus"][1]["uuid"] = data["gpus"][0]["uuid"]
    return data


def _hca_two_fabrics():
    data = payload()
    data["fabrics"] = [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]}, {"name": "ib-b", "hcas": ["mlx5_1"]}]
    data["hcas"][1]["fabric"] = None
    return data


def _huge_memory():
    data = payload()
    data["gpus"][0]["memory_mib"] = 10**12
    return data


def _nul_in_string():
    return payload(agent_version="0.1\x00")


# (case, raw body or JSON value, status, text the error must contain)
REFUSALS = [
    ("malformed JSON", b'{"agent_version": "0.1", ', 400, "not valid JSON"),
    ("not UTF-8", b'{"agent_version": "\xff"}', 400, "not valid JSON"),
    ("empty body", b"", 400, "not valid JSON"),
    ("deeply nested JSON", b"[" * 100_000 + b"]" * 100_000, 400, "JSON"),
    ("a list, not an object", [payload()], 400, "must be a JSON object"),
    ("a string, not an object", "hello", 400, "must be a JSON object"),
    ("oversized body", {"pad": "x" * (300 * 1024)}, 413, "over the limit"),
    ("HCA under two fabrics", _hca_two_fabrics(), 400, "HCA mlx5_1 is listed under two fabrics (ib-a and ib-b)"),
    ("duplicate GPU index", _dup_index(), 400, "GPU index reported more than once: [0]"),
    ("duplicate GPU uuid", _dup_uuid(), 400, "GPU uuid reported more than once"),
    ("missing agent_version", {k: v for k, v in payload().items() if k != "agent_version"}, 400, "agent_version"),
    ("GPU memory out of range", _huge_memory(), 400, "memory_mib"),
    ("NUL in a string", _nul_in_string(), 400, "agent_version"),
    ("gpus not a list", payload(gpus="eight"), 400, "gpus"),
]


def _send(server, creds, node_id, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return post(server, creds, node_id, content=content, headers={"Content-Type": "application/json"})


def _error_text(r: httpx.Response) -> str:
    data = r.json()
    return data["error"] + " " + json.dumps(data.get("details", {}))


def test_invalid_heartbeats_of_a_new_node_are_refused_and_store_nothing(agent_api, client_cert):
    creds = client_cert("node03")
    before = snapshot()
    for case, body, status, text in REFUSALS:
        r = _send(agent_api, creds, "node03", body)
        assert r.status_code == status, f"{case}: {r.status_code} {r.text[:500]}"
        assert text in _error_text(r), f"{case}: {r.text[:500]}"
        assert snapshot() == before, f"{case}: something was stored"
    assert not Node.objects.filter(name="node03").exists()
    # The listener is still healthy, and the same node registers once it sends sense.
    assert post(agent_api, creds, "node03").status_code == 200


def test_invalid_heartbeats_of_a_known_node_leave_its_inventory_alone(agent_api, client_cert):
    creds = client_cert("node01")
    assert post(agent_api, creds, "node01").status_code == 200
    before = snapshot()
    for case, body, status, text in REFUSALS:
        r = _send(agent_api, creds, "node01", body)
        assert r.status_code == status, f"{case}: {r.status_code} {r.text[:500]}"
        assert text in _error_text(r), f"{case}: {r.text[:500]}"
        assert snapshot() == before, f"{case}: something was stored"


def _chunked(data: bytes, size: int = 16 * 1024):
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_chunked_bodies_are_read_and_limited(agent_api, client_cert):
    """No Content-Length to check up front: the limit holds while reading."""
    creds = client_cert("node01")
    big = json.dumps({"pad": "x" * (300 * 1024)}).encode()
    r = post(agent_api, creds, "node01", content=_chunked(big), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert "over the limit" in r.json()["error"]
    assert not Node.objects.exists()

    good = json.dumps(payload()).encode()
    r = post(agent_api, creds, "node01", content=_chunked(good, 500), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert Node.objects.get(name="node01").gpus.count() == 8


def test_refused_heartbeats_leave_no_liveness_mark(agent_api, client_cert):
    creds = client_cert("node04")
    for body in (_dup_index(), _hca_two_fabrics(), b"{"):
        r = _send(agent_api, creds, "node04", body)
        assert r.status_code == 400
    r = post(agent_api, client_cert("node02"), "node04")
    assert r.status_code == 403
    assert liveness.store().seen("node04") is None


def test_gpu_already_on_another_node_is_a_conflict_recorded_not_a_refusal(agent_api, client_cert):
    owner = client_cert("node01")
    assert post(agent_api, owner, "node01").status_code == 200
    r = post(agent_api, client_cert("node02"), "node02", payload(mgmt_addr="127.0.1.2"))
    # The claimant registers without the GPUs node01 holds; neither node's heartbeats fail.
    assert r.status_code == 200, r.text
    assert not Gpu.objects.filter(node__name="node02").exists()
    assert Gpu.objects.filter(node__name="node01").count() == 8
    conflicts = Event.objects.filter(kind=NodeEventKind.GPU_CONFLICT)
    assert {e.node.name for e in conflicts} == {"node01", "node02"}
    assert {e.data["gpu"] for e in conflicts} == {g["uuid"] for g in payload()["gpus"]}
    assert all("node01 keeps it" in e.message for e in conflicts)
    assert post(agent_api, owner, "node01", payload(mgmt_addr="127.0.1.9")).status_code == 200


def test_invalid_node_id_in_url_is_refused(agent_api, client_cert):
    creds = client_cert("node01")
    r = post(agent_api, creds, "Node01")
    assert r.status_code in (400, 403), r.text
    assert not Node.objects.exists()


def test_only_post(agent_api, client_cert):
    creds = client_cert("node01")
    with mtls_client(*creds, timeout=10) as client:
        assert client.get(heartbeat_url(agent_api, "node01")).status_code == 405
    assert not Node.objects.exists()


# --- what a heartbeat stores and answers ---------------------------------------------


def test_first_heartbeat_registers_the_node_with_an_event(agent_api, client_cert):
    creds = client_cert("node01")
    r = post(agent_api, creds, "node01")
    assert r.status_code == 200, r.text
    node = Node.objects.get(name="node01")
    assert node.status == NodeStatus.READY
    assert node.mgmt_addr == "127.0.1.1" and node.mgmt_interface == "lo" and node.agent_version == "0.1.0"
    assert list(node.gpus.values_list("index", flat=True)) == list(range(8))
    gpu0 = node.gpus.get(index=0)
    assert (gpu0.name, gpu0.memory_mib, gpu0.pci_bus_id) == ("NVIDIA H200", 143771, "00000000:18:00.0")
    assert sorted(node.hcas.values_list("name", "fabric__name", "state", "rate")) == [
        ("mlx5_0", "ib-a", "ACTIVE", "400 Gb/sec (4X NDR)"),
        ("mlx5_1", "ib-a", "ACTIVE", "400 Gb/sec (4X NDR)"),
    ]
    assert list(node.fabrics.values_list("name", flat=True)) == ["ib-a"]
    registered = Event.objects.get(node=node, kind=NodeEventKind.NODE_REGISTERED)
    assert "8 GPUs" in registered.message and "ib-a" in registered.message
    status = Event.objects.get(node=node, kind=NodeEventKind.NODE_STATUS)
    assert status.data == {"from": "registered", "to": "ready"}
    # Heard: the liveness store knows it.
    assert liveness.store().seen("node01") is not None

    # A second, identical heartbeat registers nothing new.
    events = Event.objects.count()
    assert post(agent_api, creds, "node01").status_code == 200
    assert Event.objects.count() == events


def test_reply_carries_desired_state_and_heartbeat_interval(agent_api_factory, client_cert):
    server = agent_api_factory(LLMGW_HEARTBEAT_INTERVAL="7.5")
    r = post(server, client_cert("node01"), "node01")
    assert r.status_code == 200, r.text
    data = r.json()
    reply = HeartbeatReply.from_dict(data)
    assert reply.node == "node01"
    assert reply.status == NodeStatus.READY
    assert reply.heartbeat_interval == 7.5
    assert reply.desired.version == Node.objects.get(name="node01").desired_version
    assert reply.desired.members == []


def test_a_heartbeat_from_a_newer_agent_is_accepted_and_its_unknown_fields_ignored(agent_api, client_cert):
    data = payload(power_watts=5400, boot_id="b1")
    data["gpus"][0]["temperature_c"] = 41
    data["hcas"][0]["numa_node"] = 1
    data["fabrics"][0]["subnet_manager"] = "opensm"
    r = post(agent_api, client_cert("node01"), "node01", data)
    assert r.status_code == 200, r.text
    assert HeartbeatReply.from_dict(r.json()).status == NodeStatus.READY
    node = Node.objects.get(name="node01")
    assert node.gpus.count() == 8 and node.gpus.get(index=0).memory_mib == 143771
    assert list(node.hcas.order_by("name").values_list("name", "fabric__name")) == [
        ("mlx5_0", "ib-a"), ("mlx5_1", "ib-a")]


def test_inventory_change_updates_the_stored_gpus(agent_api, client_cert):
    creds = client_cert("node01")
    assert post(agent_api, creds, "node01").status_code == 200
    data = payload()
    removed = data["gpus"].pop(3)
    data["hcas"][1]["state"] = "DOWN"
    r = post(agent_api, creds, "node01", data)
    assert r.status_code == 200, r.text
    node = Node.objects.get(name="node01")
    assert sorted(node.gpus.filter(missing_since=None).values_list("index", flat=True)) == [0, 1, 2, 4, 5, 6, 7]
    # Not reported any more: kept, marked missing (the node keeps its claim on the uuid).
    assert Gpu.objects.get(uuid=removed["uuid"]).missing_since is not None
    assert node.hcas.get(name="mlx5_1").state == "DOWN"

    # The GPU comes back, and the indices are renumbered as nvidia-smi does.
    data = payload()
    data["gpus"][0]["index"], data["gpus"][1]["index"] = 1, 0
    assert post(agent_api, creds, "node01", data).status_code == 200
    stored = dict(node.gpus.filter(missing_since=None).values_list("uuid", "index"))
    assert len(stored) == 8
    assert stored[data["gpus"][0]["uuid"]] == 1 and stored[data["gpus"][1]["uuid"]] == 0


def test_fabric_change_moves_the_node(agent_api, client_cert):
    creds = client_cert("node01")
    assert post(agent_api, creds, "node01").status_code == 200
    data = example_heartbeat(fabric="ib-b").to_dict()
    assert post(agent_api, creds, "node01", data).status_code == 200
    node = Node.objects.get(name="node01")
    assert list(node.fabrics.values_list("name", flat=True)) == ["ib-b"]
    assert set(node.hcas.values_list("fabric__name", flat=True)) == {"ib-b"}
    # An island: no fabric, no HCAs.
    data = example_heartbeat(fabric=None).to_dict()
    assert post(agent_api, creds, "node01", data).status_code == 200
    assert not node.fabrics.exists() and not node.hcas.exists()


def test_hca_fabric_comes_from_the_stated_membership(agent_api, client_cert):
    """An agent may state membership only under 'fabrics'; the HCA still belongs to it."""
    creds = client_cert("node01")
    data = payload()
    for hca in data["hcas"]:
        hca["fabric"] = None
    assert post(agent_api, creds, "node01", data).status_code == 200
    assert set(Hca.objects.filter(node__name="node01").values_list("fabric__name", flat=True)) == {"ib-a"}


def test_discovery_error_is_stored_and_shown(agent_api, client_cert, admin_token):
    from rest_framework.test import APIClient

    creds = client_cert("node01")
    assert post(agent_api, creds, "node01").status_code == 200
    problem = "nvidia-smi: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"
    r = post(agent_api, creds, "node01", payload(gpus=[], discovery_errors=[problem]))
    assert r.status_code == 200, r.text
    node = Node.objects.get(name="node01")
    assert node.discovery_errors == [problem]
    assert not node.gpus.filter(missing_since=None).exists()
    event = Event.objects.filter(node=node, kind=NodeEventKind.NODE_INVENTORY).latest("id")
    assert problem in event.message and event.severity == "warning"

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {admin_token}")
    listed = api.get("/api/v1/nodes/node01/").json()
    assert listed["discovery_errors"] == [problem]

    # Fixed: the error is cleared, and that is an event too.
    assert post(agent_api, creds, "node01").status_code == 200
    node.refresh_from_db()
    assert node.discovery_errors == []
    assert "none" in Event.objects.filter(node=node, kind=NodeEventKind.NODE_INVENTORY).latest("id").message


def test_first_heartbeat_with_discovery_errors_is_recorded(agent_api, client_cert):
    creds = client_cert("node01")
    r = post(agent_api, creds, "node01", payload(discovery_errors=["mlx5_1: ports/1/state unreadable"]))
    assert r.status_code == 200
    event = Event.objects.get(node__name="node01", kind=NodeEventKind.NODE_INVENTORY)
    assert "mlx5_1: ports/1/state unreadable" in event.message


# --- starvation -------------------------------------------------------------------------


def _partial_client_hello(ca: str) -> bytes:
    """The first bytes of a real ClientHello, as a stalled client would send them."""
    context = ssl.create_default_context(cafile=ca)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    assert hello[:1] == b"\x16"  # a TLS handshake record
    return hello[: len(hello) // 2]


def _accept_queue(port: int) -> int:
    """Connections the kernel holds for the listener on ``port`` that it has not accepted yet."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on port {port}")


def test_idle_and_half_open_connections_do_not_starve_heartbeats(agent_api_factory, client_cert):
    # Stalled handshakes are given a minute: a listener they starved could not
    # answer the heartbeats below within the clients' 10 s, nor still hold them.
    server = agent_api_factory(workers=1, threads=4, LLMGW_AGENT_HANDSHAKE_TIMEOUT="60")
    cert, key, ca = client_cert("node01")
    # Warm the worker (first request: lazy imports, database and Redis
    # connections) so that what is measured below is waiting, not start-up.
    assert post(server, (cert, key, ca), "node01").status_code == 200
    held: list[socket.socket] = []
    try:
        for _ in range(64):
            held.append(socket.create_connection((server.host, server.port), timeout=5))
        hello = _partial_client_hello(ca)
        for _ in range(8):
            sock = socket.create_connection((server.host, server.port), timeout=5)
            sock.sendall(hello)
            held.append(sock)
        # The worker has accepted all of them before the real agent arrives.
        wait_until(lambda: _accept_queue(server.port) == 0, timeout=10, message="the listener accepting them all")

        # A new connection, as an agent reconnecting: handshake and heartbeat.
        with httpx.Client(verify=mtls_context(cert, key, ca), timeout=10) as client:
            r = client.post(heartbeat_url(server, "node01"), json=payload())
        assert r.status_code == 200, r.text

        # The stalled connections are still held open (the server did not just
        # shed them), and a second agent gets through as well.
        still_open = 0
        for sock in held[:8]:
            sock.setblocking(False)
            try:
                still_open += sock.recv(1) != b""
            except BlockingIOError:
                still_open += 1
            except OSError:
                pass
        assert still_open == 8
        r = post(server, client_cert("node02"), "node02", example_heartbeat(gpus=0).to_dict())
        assert r.status_code == 200, r.text
    finally:
        for sock in held:
            sock.close()
