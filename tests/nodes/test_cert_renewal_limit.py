"""A node certificate cannot mint certificates in a loop: renewal is bounded
per certificate, 429 with Retry-After (issue 19, item 7)."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pki.signing import renewal_wait
from pki.models import Certificate
from tests.conftest import mtls_client

pytestmark = pytest.mark.django_db(transaction=True)


def fresh_csr(node_id: str) -> tuple[str, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
           .sign(key, hashes.SHA256()))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return csr.public_bytes(serialization.Encoding.PEM).decode(), pem


def renew(server, creds, node_id: str):
    csr, key = fresh_csr(node_id)
    with mtls_client(*creds, timeout=10) as client:
        return client.post(f"{server.url}/agent/v1/nodes/{node_id}/certificate", json={"csr": csr}), key


def test_renewals_in_a_loop_are_refused_with_retry_after(agent_api_factory, client_cert, tmp_path):
    api = agent_api_factory(LLMGW_CERT_RENEW_INTERVAL="2")
    creds = client_cert("ren-node")
    for _ in range(5):
        r, _key = renew(api, creds, "ren-node")
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["Retry-After"]) <= 2
    assert Certificate.objects.filter(common_name="ren-node").count() == 1

    time.sleep(2.1)
    r, key = renew(api, creds, "ren-node")
    assert r.status_code == 200, r.text
    assert Certificate.objects.filter(common_name="ren-node").count() == 2
    # The new certificate cannot renew itself at once either.
    cert_path, key_path = tmp_path / "new.pem", tmp_path / "new-key.pem"
    cert_path.write_text(r.json()["certificate"])
    key_path.write_bytes(key)
    r, _key = renew(api, (str(cert_path), str(key_path), creds[2]), "ren-node")
    assert r.status_code == 429 and "Retry-After" in r.headers, r.text
    assert Certificate.objects.filter(common_name="ren-node").count() == 2


def test_a_short_lived_or_expiring_certificate_is_never_held_back():
    now = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    day = dt.timedelta(days=1)
    # A month-long certificate: an hour after issue.
    assert renewal_wait(issued_at=now, not_after=now + 30 * day, now=now, interval=3600) == 3600
    assert renewal_wait(issued_at=now, not_after=now + 30 * day, now=now + dt.timedelta(hours=1), interval=3600) == 0
    # A 30 s certificate: after 15 s, whatever the interval.
    assert renewal_wait(issued_at=now, not_after=now + dt.timedelta(seconds=30), now=now, interval=3600) == 15
