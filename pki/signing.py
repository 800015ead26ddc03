"""Signing a node's certificate request: the node made its key and keeps it;
only the request comes here, and only the certificate goes back."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from .choices import CertificateKind
from .models import Certificate
from .names import InvalidNodeId, validate_node_id
from .services import PkiError, _build, _ca, _record, cert_mark_revoked

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Signed:
    row: Certificate
    cert_pem: bytes
    ca_pem: bytes
    # False when an earlier signing of this very key was handed back.
    new: bool


def csr_load(csr_pem: bytes | str) -> x509.CertificateSigningRequest:
    data = csr_pem.encode() if isinstance(csr_pem, str) else csr_pem
    try:
        csr = x509.load_pem_x509_csr(data)
    except ValueError as exc:
        raise PkiError(f"not a PEM certificate request: {exc}") from None
    if not csr.is_signature_valid:
        raise PkiError("the certificate request's signature does not verify: it was not made with its key")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise PkiError("the certificate request's key must be ECDSA P-256, as 'llmgw-agent csr' makes")
    return csr


def csr_common_name(csr: x509.CertificateSigningRequest) -> str:
    names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if len(names) == 1 else ""


def _same_key(row: Certificate, key: ec.EllipticCurvePublicKey) -> bool:
    cert = x509.load_pem_x509_certificate(row.pem.encode())
    return cert.public_key().public_numbers() == key.public_numbers()


def cert_sign_node(
    *, node_id: str, csr_pem: bytes | str, days: int | None = None, lifetime: dt.timedelta | None = None
) -> Signed:
    """A client certificate (CN = node id, clientAuth) for the key in the
    request, only if the request's CN is exactly this node id. A key already
    signed, live and unrevoked, gets its certificate back: signing is idempotent."""
    try:
        validate_node_id(node_id)
    except InvalidNodeId as exc:
        raise PkiError(str(exc)) from None
    csr = csr_load(csr_pem)
    cn = csr_common_name(csr)
    if cn != node_id:
        raise PkiError(f"the request is for CN {cn!r}, not {node_id!r}: a node's certificate names the node itself")
    key = csr.public_key()
    if lifetime is None:
        lifetime = node_cert_lifetime() if days is None else dt.timedelta(days=days)
    if lifetime <= dt.timedelta(0):
        raise PkiError("a certificate's lifetime must be positive")
    _ca_cert, _ca_key, ca_pem = _ca()
    with transaction.atomic():
        live = Certificate.objects.select_for_update().filter(
            common_name=node_id, kind=CertificateKind.CLIENT, revoked_at=None, not_after__gt=timezone.now()
        )
        for row in live:
            if _same_key(row, key):
                return Signed(row, row.pem.encode(), ca_pem, new=False)
        now = dt.datetime.now(dt.timezone.utc)
        # Valid a little before now (clocks differ; onboarding's preflight
        # bounds them to a minute), and for the whole lifetime from now.
        backdate = min(dt.timedelta(minutes=5), lifetime / 10)
        cert, ca_pem = _build(common_name=node_id, public_key=key, usage=ExtendedKeyUsageOID.CLIENT_AUTH,
                              sans=[x509.DNSName(node_id)], lifetime=lifetime,
                              not_before=now - backdate, not_after=now + lifetime)
        row = _record(cert, kind=CertificateKind.CLIENT, sans=[node_id])
    logger.info("pki node certificate signed node=%s serial=%s until=%s", node_id, row.serial, row.not_after)
    return Signed(row, cert.public_bytes(serialization.Encoding.PEM), ca_pem, new=True)


class RenewalTooSoon(PkiError):
    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def renewal_wait(*, issued_at: dt.datetime, not_after: dt.datetime, now: dt.datetime, interval: float) -> float:
    """Seconds until a certificate issued then may be renewed (0: now).

    Agents renew at two thirds of the lifetime; a certificate renewed again
    and again within moments is a stolen key making certificates, or a
    broken agent. So a certificate may be renewed once it is ``interval``
    seconds old, or once it has lived half its lifetime, whichever comes
    first: a short-lived or expiring certificate is never held back."""
    lifetime = (not_after - issued_at).total_seconds()
    allowed_at = issued_at + dt.timedelta(seconds=max(0.0, min(interval, lifetime / 2)))
    return max(0.0, (allowed_at - now).total_seconds())


def cert_renew(*, node_id: str, csr_pem: bytes | str, current_serial: str) -> Signed:
    """The next certificate of a node that proved itself with its current
    one (the caller checked the CN and that it is not revoked). The request
    must carry a fresh key; the current serial is superseded: revoked, with
    "superseded by NEW" as the reason, refused from now on. Runs in the
    caller's transaction when there is one (nodes records its Event there)."""
    csr = csr_load(csr_pem)
    with transaction.atomic():
        current = Certificate.objects.select_for_update().filter(serial=current_serial).first()
        if current is None or current.common_name != node_id or current.revoked_at is not None:
            raise PkiError(f"certificate {current_serial} is not a live certificate of {node_id}")
        wait = renewal_wait(issued_at=current.issued_at, not_after=current.not_after, now=timezone.now(),
                            interval=settings.LLMGW_CERT_RENEW_INTERVAL)
        if wait > 0:
            raise RenewalTooSoon(f"certificate {current_serial} was issued {timezone.now() - current.issued_at} ago; "
                                 f"it may be renewed in {wait:.0f}s", retry_after=max(1, int(wait + 0.999)))
        if _same_key(current, csr.public_key()):
            raise PkiError("the request reuses the current key: make a fresh one for each certificate")
        signed = cert_sign_node(node_id=node_id, csr_pem=csr_pem, lifetime=node_cert_lifetime())
        cert_mark_revoked(row=current, reason=f"superseded by {signed.row.serial}")
    logger.info("pki node certificate renewed node=%s old=%s new=%s", node_id, current_serial, signed.row.serial)
    return signed


def node_cert_lifetime() -> dt.timedelta:
    seconds = settings.LLMGW_NODE_CERT_SECONDS
    return dt.timedelta(seconds=seconds) if seconds > 0 else dt.timedelta(days=settings.LLMGW_NODE_CERT_DAYS)

