"""Signing a node's own certificate request: the key stays where it was made."""

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.identity import csr_make, key_ensure
from pki.models import Certificate
from pki.services import PkiError
from pki.signing import cert_sign_node

pytestmark = pytest.mark.django_db


def _csr(key, cn: str) -> bytes:
    return (x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))


def test_a_request_for_the_node_is_signed_for_client_auth_with_the_short_default_lifetime(pki_dir, tmp_path, settings):
    settings.LLMGW_NODE_CERT_DAYS = 30
    key = key_ensure(tmp_path / "k.pem")
    assert (tmp_path / "k.pem").stat().st_mode & 0o777 == 0o600
    signed = cert_sign_node(node_id="sig-node01", csr_pem=csr_make(node_id="sig-node01", key=key))
    cert = x509.load_pem_x509_certificate(signed.cert_pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "sig-node01"
    assert cert.public_key().public_numbers() == key.public_key().public_numbers()
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=30) <= lifetime <= dt.timedelta(days=30, minutes=10)
    assert signed.new and Certificate.objects.filter(common_name="sig-node01").count() == 1


def test_the_same_key_is_never_signed_twice(pki_dir, tmp_path):
    key = key_ensure(tmp_path / "k.pem")
    first = cert_sign_node(node_id="sig-node02", csr_pem=csr_make(node_id="sig-node02", key=key))
    # A rerun reuses the key on disk.
    again = cert_sign_node(node_id="sig-node02", csr_pem=csr_make(node_id="sig-node02", key=key_ensure(tmp_path / "k.pem")))
    assert not again.new and again.row.pk == first.row.pk and again.cert_pem == first.cert_pem
    fresh = cert_sign_node(node_id="sig-node02", csr_pem=csr_make(node_id="sig-node02",
                                                                 key=key_ensure(tmp_path / "k.pem", fresh=True)))
    assert fresh.new and Certificate.objects.filter(common_name="sig-node02").count() == 2


@pytest.mark.parametrize("node, cn, key, message", [
    ("sig-node03", "sig-other", "ec", "not 'sig-node03'"),
    ("Not_A_Node", "Not_A_Node", "ec", "not a valid node id"),
    ("sig-node03", "sig-node03", "rsa", "ECDSA P-256"),
])
def test_requests_that_do_not_name_this_node_or_use_another_key_type_are_refused(pki_dir, node, cn, key, message):
    private = ec.generate_private_key(ec.SECP256R1()) if key == "ec" else rsa.generate_private_key(65537, 2048)
    with pytest.raises(PkiError, match=message):
        cert_sign_node(node_id=node, csr_pem=_csr(private, cn))
    assert not Certificate.objects.filter(common_name__in=[node, cn]).exists()


def test_garbage_is_not_a_request(pki_dir):
    with pytest.raises(PkiError, match="not a PEM certificate request"):
        cert_sign_node(node_id="sig-node04", csr_pem="hello")
