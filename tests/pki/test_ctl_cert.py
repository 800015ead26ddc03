"""``llmgw ctl cert`` as an operator runs it: a real subprocess on the local PKI."""

import json
import stat
import subprocess

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pki.choices import CertificateKind
from pki.models import Certificate
from tests.conftest import REPO, server_env

pytestmark = pytest.mark.django_db(transaction=True)

LLMGW = str(REPO / ".venv" / "bin" / "llmgw")


@pytest.fixture(autouse=True)
def _no_certificates_yet():
    """Rows of the session's test authority may be left in the database (the
    test database is flushed after this test anyway): start from none, as an
    operator's new authority does."""
    Certificate.objects.all().delete()


@pytest.fixture
def ctl(tmp_path):
    """run(*args) -> CompletedProcess of ``llmgw ctl cert ...`` on a PKI directory of its own."""
    env = server_env(LLMGW_DATA_DIR=str(tmp_path / "data"), LLMGW_PKI_DIR=str(tmp_path / "pki"))

    def run(*args: str, check_rc: int | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [LLMGW, "ctl", "cert", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
        )
        if check_rc is not None:
            assert proc.returncode == check_rc, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    run.pki = tmp_path / "pki"
    return run


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_ca_then_refuses_to_overwrite(ctl):
    first = ctl("init-ca", "--cn", "ops CA", check_rc=0)
    assert "created authority 'ops CA'" in first.stdout
    key_before = (ctl.pki / "ca-key.pem").read_bytes()
    assert _mode(ctl.pki / "ca-key.pem") == 0o600

    second = ctl("init-ca", check_rc=1)
    assert "llmgw: an authority already exists" in second.stderr
    assert "Traceback" not in second.stderr
    assert (ctl.pki / "ca-key.pem").read_bytes() == key_before
    assert Certificate.objects.filter(kind=CertificateKind.CA).count() == 1


def test_issue_client_without_authority_says_how(ctl, tmp_path):
    proc = ctl("issue-client", "node01", "--out", str(tmp_path / "out"), check_rc=1)
    assert "run 'llmgw ctl cert init-ca' first" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_issue_client_writes_the_bundle(ctl, tmp_path):
    ctl("init-ca", check_rc=0)
    out = tmp_path / "bundle"
    proc = ctl("issue-client", "node01", "--out", str(out), "--days", "10", check_rc=0)
    assert "issued node01 serial" in proc.stdout
    assert str(out / "node01-key.pem") in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["ca.pem", "node01-key.pem", "node01.pem"]
    assert _mode(out / "node01-key.pem") == 0o600
    assert (out / "ca.pem").read_bytes() == (ctl.pki / "ca.pem").read_bytes()
    cert = x509.load_pem_x509_certificate((out / "node01.pem").read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node01"
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH
    ]
    row = Certificate.objects.get(common_name="node01")
    assert row.serial == format(cert.serial_number, "x")
    assert (row.not_after - row.not_before).days == 10


def test_issue_client_refuses_invalid_node_ids(ctl, tmp_path):
    ctl("init-ca", check_rc=0)
    for node_id in ("Node01", "node_01", "node01."):
        proc = ctl("issue-client", node_id, "--out", str(tmp_path / "bundle"), check_rc=1)
        assert f"{node_id!r} is not a valid node id" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "bundle").exists()
    assert not Certificate.objects.filter(kind=CertificateKind.CLIENT).exists()


def test_issue_client_requires_out(ctl):
    proc = ctl("issue-client", "node01", check_rc=2)
    assert "--out" in proc.stderr


def test_issue_server_with_subject_alternative_names(ctl, tmp_path):
    ctl("init-ca", check_rc=0)
    out = tmp_path / "server"
    proc = ctl("issue-server", "--host", "cp.example", "--ip", "127.0.0.1", "--ip", "::1", "--out", str(out), check_rc=0)
    assert "names cp.example, 127.0.0.1, ::1" in proc.stdout
    assert _mode(out / "server-key.pem") == 0o600
    cert = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["cp.example"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    # Not installed: the listener's own certificate is untouched.
    assert not (ctl.pki / "server.pem").exists()


def test_issue_server_install(ctl):
    ctl("init-ca", check_rc=0)
    proc = ctl("issue-server", "--ip", "127.0.0.1", "--install", check_rc=0)
    assert "restart the agent API" in proc.stdout
    assert _mode(ctl.pki / "server-key.pem") == 0o600


def test_issue_server_refusals(ctl):
    ctl("init-ca", check_rc=0)
    for args, message in [
        (["--host", "cp"], "say where it goes"),
        (["--ip", "not-an-ip", "--install"], "'not-an-ip' is not an IP address"),
        (["--install"], "at least one --host or --ip"),
    ]:
        proc = ctl("issue-server", *args, check_rc=1)
        assert message in proc.stderr
    assert not Certificate.objects.filter(kind=CertificateKind.SERVER).exists()
    assert not (ctl.pki / "server.pem").exists()


def test_list_json_and_table(ctl, tmp_path):
    ctl("init-ca", check_rc=0)
    ctl("issue-client", "node01", "--out", str(tmp_path / "n1"), check_rc=0)
    ctl("issue-server", "--host", "cp", "--install", check_rc=0)
    rows = json.loads(ctl("list", "-o", "json", check_rc=0).stdout)
    assert sorted((r["kind"], r["common_name"]) for r in rows) == [
        ("ca", "llmgw CA"),
        ("client", "node01"),
        ("server", "cp"),
    ]
    for row in rows:
        assert {"serial", "fingerprint_sha256", "not_before", "not_after", "revoked_at"} <= row.keys()
        assert row["revoked_at"] is None
    table = ctl("list", check_rc=0).stdout.splitlines()
    assert table[0].split() == ["cn", "kind", "serial", "expires", "revoked"]
    client = next(r for r in rows if r["kind"] == "client")
    assert any(line.split()[:3] == ["node01", "client", client["serial"]] for line in table[1:])


def test_revoke_by_node_by_serial_and_refusals(ctl, tmp_path):
    ctl("init-ca", check_rc=0)
    ctl("issue-client", "node01", "--out", str(tmp_path / "n1"), check_rc=0)
    ctl("issue-client", "node02", "--out", str(tmp_path / "n2"), check_rc=0)
    node02 = Certificate.objects.get(common_name="node02")
    ca = Certificate.objects.get(kind=CertificateKind.CA)

    proc = ctl("revoke", "node01", "--reason", "stolen laptop", check_rc=0)
    assert "revoked client certificate" in proc.stdout and "(node01)" in proc.stdout
    row = Certificate.objects.get(common_name="node01")
    assert row.revoked_at is not None and row.revocation_reason == "stolen laptop"

    assert "already revoked" in ctl("revoke", "node01", check_rc=1).stderr

    proc = ctl("revoke", node02.serial, check_rc=0)
    assert node02.serial in proc.stdout
    node02.refresh_from_db()
    assert node02.revoked_at is not None

    unknown = ctl("revoke", "node99", check_rc=1)
    assert "no certificate has serial 'node99'" in unknown.stderr
    assert "llmgw ctl cert list" in unknown.stderr

    refused = ctl("revoke", ca.serial, check_rc=1)
    assert "cannot be revoked" in refused.stderr
    ca.refresh_from_db()
    assert ca.revoked_at is None

    listed = {r["common_name"]: r for r in json.loads(ctl("list", "-o", "json", check_rc=0).stdout)}
    assert listed["node01"]["revoked_at"] and listed["node02"]["revoked_at"]
    assert listed["llmgw CA"]["revoked_at"] is None


def test_unreachable_database_is_a_message_not_a_traceback(tmp_path):
    env = server_env(
        LLMGW_DATA_DIR=str(tmp_path / "data"),
        LLMGW_PKI_DIR=str(tmp_path / "pki"),
        DATABASE_URL="postgres://postgres@127.0.0.1:1/nowhere",
    )
    proc = subprocess.run([LLMGW, "ctl", "cert", "list"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "llmgw: cannot reach the database" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sign_a_nodes_request_by_hand(ctl, tmp_path):
    from agent.identity import csr_make, key_ensure

    ctl("init-ca", check_rc=0)
    key = key_ensure(tmp_path / "node-key.pem")
    (tmp_path / "node.csr").write_bytes(csr_make(node_id="node07", key=key))
    signed = ctl("sign", "node07", "--csr", str(tmp_path / "node.csr"), "--out", str(tmp_path / "out"), check_rc=0)
    assert "signed node07 serial" in signed.stdout
    cert = x509.load_pem_x509_certificate((tmp_path / "out" / "node07.pem").read_bytes())
    assert cert.public_key().public_numbers() == key.public_key().public_numbers()
    assert (tmp_path / "out" / "ca.pem").exists() and not list((tmp_path / "out").glob("*key*"))
    # The same request again: the same certificate, nothing signed twice.
    again = ctl("sign", "node07", "--csr", str(tmp_path / "node.csr"), check_rc=0)
    assert again.stdout.strip() == (tmp_path / "out" / "node07.pem").read_text().strip()
    assert "already signed" in again.stderr
    wrong = ctl("sign", "node08", "--csr", str(tmp_path / "node.csr"), check_rc=1)
    assert "the request is for CN 'node07', not 'node08'" in wrong.stderr
