"""The certificate authority: ECDSA P-256, files under ``settings.PKI_DIR``.

The authority's key and the agent API's server key never leave the PKI
directory. A client key is written once, to the directory the operator names,
and is not kept here.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from . import hooks
from .choices import CertificateKind
from .models import Certificate
from .names import validate_node_id
from .selectors import revoked_serials

logger = logging.getLogger(__name__)

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
SERVER_CERT = "server.pem"
SERVER_KEY = "server-key.pem"


class PkiError(Exception):
    """A PKI operation that cannot be done as asked; the message says why."""


@dataclass(frozen=True)
class Issued:
    row: Certificate
    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes


def pki_dir() -> Path:
    return Path(settings.PKI_DIR)


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    # An existing file keeps its mode through O_CREAT: tighten it before the
    # key is written, not after.
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _write_public(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(data)
    os.chmod(path, mode)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _fingerprint(cert: x509.Certificate) -> str:
    return cert.fingerprint(hashes.SHA256()).hex()


def _record(cert: x509.Certificate, *, kind: str, sans: list[str]) -> Certificate:
    common_name = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    return Certificate.objects.create(
        serial=format(cert.serial_number, "x"),
        common_name=common_name,
        kind=kind,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        fingerprint_sha256=_fingerprint(cert),
        subject_alt_names=sans,
        pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
    )


def ca_exists() -> bool:
    return (pki_dir() / CA_KEY).exists() or (pki_dir() / CA_CERT).exists()


def ca_init(*, common_name: str = "llmgw CA", days: int = 3650) -> Certificate:
    """Create the authority. Refuses to replace one: every node's identity hangs on it."""
    if ca_exists():
        raise PkiError(
            f"an authority already exists in {pki_dir()}; replacing it would "
            "invalidate every node's certificate. Move it away first if that is "
            "really what you want."
        )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(pki_dir() / CA_KEY, _key_pem(key))
    # Public, but the PKI directory is private as a whole (cli/datadir.py).
    _write_public(pki_dir() / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), mode=0o600)
    with transaction.atomic():
        row = _record(cert, kind=CertificateKind.CA, sans=[])
    logger.info("pki ca created cn=%s serial=%s dir=%s", common_name, row.serial, pki_dir())
    return row


def _ca() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, bytes]:
    if not (pki_dir() / CA_KEY).exists():
        raise PkiError(f"no authority in {pki_dir()}: run 'llmgw ctl cert init-ca' first")
    ca_pem = (pki_dir() / CA_CERT).read_bytes()
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key((pki_dir() / CA_KEY).read_bytes(), password=None)
    return ca_cert, ca_key, ca_pem


def _issue(
    *,
    common_name: str,
    kind: str,
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName],
    days: int,
    not_before: dt.datetime | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, bytes]:
    if days < 1:
        raise PkiError(f"a certificate must be valid for at least one day, not {days}")
    key = ec.generate_private_key(ec.SECP256R1())
    cert, ca_pem = _build(common_name=common_name, public_key=key.public_key(), usage=usage, sans=sans,
                          lifetime=dt.timedelta(days=days), not_before=not_before)
    return cert, key, ca_pem


def _build(
    *,
    common_name: str,
    public_key,
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName],
    lifetime: dt.timedelta,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> tuple[x509.Certificate, bytes]:
    ca_cert, ca_key, ca_pem = _ca()
    start = not_before or dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(not_after or start + lifetime)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), ca_pem


def cert_issue_client(
    *, node_id: str, days: int | None = None, not_before: dt.datetime | None = None
) -> Issued:
    """A node's identity: CN = node id, clientAuth usage."""
    validate_node_id(node_id)
    cert, key, ca_pem = _issue(
        common_name=node_id,
        kind=CertificateKind.CLIENT,
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        sans=[x509.DNSName(node_id)],
        days=settings.LLMGW_CERT_DAYS if days is None else days,
        not_before=not_before,
    )
    with transaction.atomic():
        row = _record(cert, kind=CertificateKind.CLIENT, sans=[node_id])
    logger.info("pki client certificate issued node=%s serial=%s", node_id, row.serial)
    return Issued(row, cert.public_bytes(serialization.Encoding.PEM), _key_pem(key), ca_pem)


def cert_issue_server(
    *, hosts: list[str], ips: list[str], days: int | None = None, install: bool = False
) -> Issued:
    """A server certificate with subject alternative names.

    With ``install`` it becomes the agent API's certificate in the PKI directory.
    """
    if not hosts and not ips:
        raise PkiError("a server certificate needs at least one --host or --ip")
    sans: list[x509.GeneralName] = [x509.DNSName(h) for h in hosts]
    for ip in ips:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(ip)))
        except ValueError as exc:
            raise PkiError(f"{ip!r} is not an IP address") from exc
    common_name = hosts[0] if hosts else ips[0]
    cert, key, ca_pem = _issue(
        common_name=common_name,
        kind=CertificateKind.SERVER,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        sans=sans,
        days=settings.LLMGW_CERT_DAYS if days is None else days,
    )
    with transaction.atomic():
        row = _record(cert, kind=CertificateKind.SERVER, sans=[*hosts, *ips])
    issued = Issued(row, cert.public_bytes(serialization.Encoding.PEM), _key_pem(key), ca_pem)
    if install:
        _write_private(pki_dir() / SERVER_KEY, issued.key_pem)
        _write_public(pki_dir() / SERVER_CERT, issued.cert_pem, mode=0o600)
    logger.info(
        "pki server certificate issued cn=%s sans=%s serial=%s", common_name, ",".join(row.subject_alt_names), row.serial
    )
    return issued


def pki_ensure_agent_listener(*, hosts: list[str], ips: list[str]) -> bool:
    """First run of ``llmgw up``: create the authority and the listener's certificate."""
    created = False
    if not ca_exists():
        ca_init()
        created = True
    if not (pki_dir() / SERVER_KEY).exists():
        cert_issue_server(hosts=hosts, ips=ips, install=True)
        created = True
    return created


def bundle_write(*, issued: Issued, out_dir: Path, name: str | None = None) -> dict[str, Path]:
    """Write NAME.pem, NAME-key.pem (0600) and ca.pem; NAME is the certificate's
    common name (a node's id) unless given."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = name or issued.row.common_name
    paths = {
        "cert": out_dir / f"{name}.pem",
        "key": out_dir / f"{name}-key.pem",
        "ca": out_dir / "ca.pem",
    }
    _write_public(paths["cert"], issued.cert_pem)
    _write_private(paths["key"], issued.key_pem)
    _write_public(paths["ca"], issued.ca_pem)
    return paths


def _serial_key(target: str) -> str:
    """A serial as we store it, from any spelling an operator copies: ours,
    ``openssl x509 -serial`` (upper case) or ``-text`` (colons, leading zeros)."""
    text = target.strip().lower().replace(":", "")
    text = text[2:] if text.startswith("0x") else text
    if text and all(c in "0123456789abcdef" for c in text):
        return text.lstrip("0") or "0"
    return target


def cert_mark_revoked(*, row: Certificate, reason: str, now: dt.datetime | None = None) -> None:
    """Record ``row`` (locked by the caller, inside its transaction) as
    revoked: the one place that writes ``revoked_at``. Revoking by hand
    (``cert_revoke``) and superseding at renewal (``signing.cert_renew``)
    both come here. This process's copy of the revoked serials is dropped
    after the commit; other processes re-read theirs within
    ``LLMGW_REVOCATION_CACHE_SECONDS``."""
    row.revoked_at = now or timezone.now()
    row.revocation_reason = reason
    row.save(update_fields=["revoked_at", "revocation_reason"])
    logger.warning("pki certificate revoked cn=%s serial=%s reason=%s", row.common_name, row.serial, reason)
    transaction.on_commit(revoked_serials.invalidate)


def cert_revoke(*, target: str, reason: str = "", actor: str = "") -> list[Certificate]:
    """Revoke by serial (hex) or by node id (every live client certificate of it).
    ``actor`` (who asked) is passed to the revocation hooks (nodes records an Event)."""
    now = timezone.now()
    serial = _serial_key(target)
    with transaction.atomic():
        rows = list(Certificate.objects.select_for_update().filter(serial=serial, revoked_at=None))
        if not rows:
            rows = list(
                Certificate.objects.select_for_update().filter(
                    common_name=target, kind=CertificateKind.CLIENT, revoked_at=None
                )
            )
        if not rows:
            if Certificate.objects.filter(serial=serial).exists() or Certificate.objects.filter(
                common_name=target, kind=CertificateKind.CLIENT
            ).exists():
                raise PkiError(f"every certificate matching {target!r} is already revoked")
            raise PkiError(
                f"no certificate has serial {target!r} or is a client certificate for node "
                f"{target!r}; 'llmgw ctl cert list' shows them"
            )
        for row in rows:
            if row.kind == CertificateKind.CA:
                raise PkiError("the authority's own certificate cannot be revoked; replace the authority")
            cert_mark_revoked(row=row, reason=reason, now=now)
            for handler in hooks.cert_revoked_handlers:
                handler(certificate=row, actor=actor, reason=reason)
    return rows
