"""The certificate authority: what it issues, what it refuses, what it revokes."""

import datetime as dt
import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pki import services
from pki.choices import CertificateKind
from pki.models import Certificate
from pki.names import InvalidNodeId
from pki.selectors import revoked_serials

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_certificates_yet():
    """The session's test authority may have left rows; these tests count
    certificates from zero (the deletion is rolled back with the test)."""
    Certificate.objects.all().delete()


@pytest.fixture
def authority(tmp_path, settings):
    """A fresh authority in its own directory (the session's test CA stays untouched)."""
    settings.PKI_DIR = tmp_path / "pki"
    row = services.ca_init(common_name="unit test CA")
    return row


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _load(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


# --- the authority ----------------------------------------------------------------


def test_init_ca_creates_a_p256_authority_with_private_key_0600(authority, settings):
    pki = settings.PKI_DIR
    ca = _load((pki / services.CA_CERT).read_bytes())
    assert ca.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "unit test CA"
    assert ca.issuer == ca.subject
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    assert ca.public_key().curve.name == "secp256r1"
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert _mode(pki / services.CA_KEY) == 0o600
    assert authority.kind == CertificateKind.CA
    assert authority.serial == format(ca.serial_number, "x")
    assert authority.fingerprint_sha256 == ca.fingerprint(hashes.SHA256()).hex()


def test_init_ca_refuses_to_overwrite_an_existing_authority(authority, settings):
    pki = settings.PKI_DIR
    before = (pki / services.CA_KEY).read_bytes(), (pki / services.CA_CERT).read_bytes()
    with pytest.raises(services.PkiError, match="already exists"):
        services.ca_init()
    assert ((pki / services.CA_KEY).read_bytes(), (pki / services.CA_CERT).read_bytes()) == before
    assert Certificate.objects.filter(kind=CertificateKind.CA).count() == 1


def test_init_ca_refuses_when_only_the_certificate_is_left(tmp_path, settings):
    settings.PKI_DIR = tmp_path / "pki"
    services.ca_init()
    (settings.PKI_DIR / services.CA_KEY).unlink()
    with pytest.raises(services.PkiError, match="already exists"):
        services.ca_init()


def test_issuing_without_an_authority_says_how_to_create_one(tmp_path, settings):
    settings.PKI_DIR = tmp_path / "empty"
    with pytest.raises(services.PkiError, match="init-ca"):
        services.cert_issue_client(node_id="node01")
    assert not Certificate.objects.exists()


# --- client certificates ----------------------------------------------------------


def test_client_certificate_is_the_node_identity(authority, settings):
    issued = services.cert_issue_client(node_id="node01", days=30)
    cert = _load(issued.cert_pem)
    ca = _load((settings.PKI_DIR / services.CA_CERT).read_bytes())

    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node01"
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    key = serialization.load_pem_private_key(issued.key_pem, password=None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(days=30)
    assert issued.ca_pem == (settings.PKI_DIR / services.CA_CERT).read_bytes()

    row = Certificate.objects.get(serial=format(cert.serial_number, "x"))
    assert row == issued.row
    assert row.common_name == "node01"
    assert row.kind == CertificateKind.CLIENT
    assert row.fingerprint_sha256 == cert.fingerprint(hashes.SHA256()).hex()
    assert row.not_before == cert.not_valid_before_utc
    assert row.not_after == cert.not_valid_after_utc
    assert row.pem.encode() == issued.cert_pem
    assert row.revoked_at is None
    # The node's key is handed out once and never kept by the authority.
    assert not any(issued.key_pem in p.read_bytes() for p in settings.PKI_DIR.iterdir() if p.is_file())


def test_client_certificate_days_default_and_not_before(authority, settings):
    settings.LLMGW_CERT_DAYS = 7
    start = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
    issued = services.cert_issue_client(node_id="node02", not_before=start)
    assert issued.row.not_before == start
    assert issued.row.not_after == start + dt.timedelta(days=7)


def test_every_issued_certificate_has_its_own_serial_and_fingerprint(authority):
    a = services.cert_issue_client(node_id="node01").row
    b = services.cert_issue_client(node_id="node01").row
    assert a.serial != b.serial
    assert a.fingerprint_sha256 != b.fingerprint_sha256
    assert Certificate.objects.filter(common_name="node01", kind=CertificateKind.CLIENT).count() == 2


@pytest.mark.parametrize(
    "node_id",
    ["", "Node01", "node_01", "-node01", "node01-", "node 01", "node01/x", "a" * 64, "nöde", "../etc"],
)
def test_invalid_node_ids_are_refused(authority, node_id):
    with pytest.raises(InvalidNodeId, match="not a valid node id"):
        services.cert_issue_client(node_id=node_id)
    assert not Certificate.objects.filter(kind=CertificateKind.CLIENT).exists()


@pytest.mark.parametrize("node_id", ["node01", "n", "gpu-7.rack2", "a" * 63, "10-0-0-7"])
def test_valid_node_ids_are_accepted(authority, node_id):
    assert services.cert_issue_client(node_id=node_id).row.common_name == node_id


def test_bundle_write_modes_and_names(authority, tmp_path):
    issued = services.cert_issue_client(node_id="node01")
    out = tmp_path / "out" / "node01"
    paths = services.bundle_write(issued=issued, out_dir=out)
    assert paths == {"cert": out / "node01.pem", "key": out / "node01-key.pem", "ca": out / "ca.pem"}
    assert paths["cert"].read_bytes() == issued.cert_pem
    assert paths["key"].read_bytes() == issued.key_pem
    assert paths["ca"].read_bytes() == issued.ca_pem
    assert _mode(paths["key"]) == 0o600
    assert _mode(paths["cert"]) == 0o644
    assert _mode(paths["ca"]) == 0o644


def test_bundle_write_tightens_an_existing_readable_key_file(authority, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stale = out / "node01-key.pem"
    stale.write_bytes(b"old")
    stale.chmod(0o644)
    issued = services.cert_issue_client(node_id="node01")
    services.bundle_write(issued=issued, out_dir=out)
    assert _mode(stale) == 0o600
    assert stale.read_bytes() == issued.key_pem


# --- server certificates ----------------------------------------------------------


def test_server_certificate_subject_alternative_names(authority):
    issued = services.cert_issue_server(hosts=["cp.example", "localhost"], ips=["127.0.0.1", "::1"])
    cert = _load(issued.cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["cp.example", "localhost"]
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "cp.example"
    assert issued.row.kind == CertificateKind.SERVER
    assert issued.row.subject_alt_names == ["cp.example", "localhost", "127.0.0.1", "::1"]


def test_server_certificate_install_writes_the_listener_files(authority, settings):
    issued = services.cert_issue_server(hosts=[], ips=["127.0.0.1"], install=True)
    assert (settings.PKI_DIR / services.SERVER_CERT).read_bytes() == issued.cert_pem
    assert (settings.PKI_DIR / services.SERVER_KEY).read_bytes() == issued.key_pem
    assert _mode(settings.PKI_DIR / services.SERVER_KEY) == 0o600
    assert issued.row.common_name == "127.0.0.1"


@pytest.mark.parametrize(
    ("hosts", "ips", "message"),
    [([], [], "at least one"), ([], ["not-an-ip"], "not an IP address"), (["ok.example"], ["300.1.1.1"], "300.1.1.1")],
)
def test_server_certificate_refusals(authority, hosts, ips, message):
    with pytest.raises(services.PkiError, match=message):
        services.cert_issue_server(hosts=hosts, ips=ips)
    assert not Certificate.objects.filter(kind=CertificateKind.SERVER).exists()


def test_pki_ensure_agent_listener_creates_once(tmp_path, settings):
    settings.PKI_DIR = tmp_path / "pki"
    assert services.pki_ensure_agent_listener(hosts=["localhost"], ips=["127.0.0.1"]) is True
    ca_before = (settings.PKI_DIR / services.CA_CERT).read_bytes()
    assert services.pki_ensure_agent_listener(hosts=["localhost"], ips=["127.0.0.1"]) is False
    assert (settings.PKI_DIR / services.CA_CERT).read_bytes() == ca_before
    assert Certificate.objects.filter(kind=CertificateKind.SERVER).count() == 1


# --- revocation -------------------------------------------------------------------


def test_revoke_by_node_revokes_every_live_client_certificate_of_it(authority):
    a = services.cert_issue_client(node_id="node01").row
    b = services.cert_issue_client(node_id="node01").row
    other = services.cert_issue_client(node_id="node02").row
    rows = services.cert_revoke(target="node01", reason="decommissioned")
    assert {r.serial for r in rows} == {a.serial, b.serial}
    for row in (a, b):
        row.refresh_from_db()
        assert row.revoked_at is not None
        assert row.revocation_reason == "decommissioned"
    other.refresh_from_db()
    assert other.revoked_at is None
    revoked_serials.invalidate()
    assert revoked_serials.get() >= {a.serial, b.serial}
    assert other.serial not in revoked_serials.get()


def test_revoke_by_serial_revokes_only_that_certificate(authority):
    a = services.cert_issue_client(node_id="node01").row
    b = services.cert_issue_client(node_id="node01").row
    rows = services.cert_revoke(target=a.serial.upper())
    assert [r.serial for r in rows] == [a.serial]
    a.refresh_from_db()
    b.refresh_from_db()
    assert a.is_revoked and not b.is_revoked


def test_revoke_by_serial_accepts_openssl_spelling(authority):
    row = services.cert_issue_client(node_id="node01").row
    openssl = ":".join(row.serial.upper().zfill(40)[i : i + 2] for i in range(0, 40, 2))
    assert [r.serial for r in services.cert_revoke(target=openssl)] == [row.serial]


def test_revoke_unknown_target_says_where_to_look(authority):
    with pytest.raises(services.PkiError, match=r"no certificate .*'node99'.*llmgw ctl cert list"):
        services.cert_revoke(target="node99")


def test_revoke_twice_says_already_revoked(authority):
    services.cert_issue_client(node_id="node01")
    services.cert_revoke(target="node01")
    with pytest.raises(services.PkiError, match="already revoked"):
        services.cert_revoke(target="node01")


def test_the_authority_cannot_be_revoked(authority):
    with pytest.raises(services.PkiError, match="authority's own certificate cannot be revoked"):
        services.cert_revoke(target=authority.serial)
    authority.refresh_from_db()
    assert authority.revoked_at is None


def test_revoke_by_node_name_does_not_touch_server_certificates(authority):
    server = services.cert_issue_server(hosts=["node01"], ips=[]).row
    with pytest.raises(services.PkiError, match="no certificate"):
        services.cert_revoke(target="node01")
    server.refresh_from_db()
    assert server.revoked_at is None
    # By serial, a server certificate can be revoked.
    assert [r.serial for r in services.cert_revoke(target=server.serial)] == [server.serial]


@pytest.mark.parametrize("days", [0, -5])
def test_a_certificate_valid_for_no_time_is_refused(authority, days):
    with pytest.raises(services.PkiError, match="at least one day"):
        services.cert_issue_client(node_id="node01", days=days)
    with pytest.raises(services.PkiError, match="at least one day"):
        services.cert_issue_server(hosts=["cp"], ips=[], days=days)
    assert not Certificate.objects.exclude(kind=CertificateKind.CA).exists()
