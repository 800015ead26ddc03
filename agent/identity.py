"""The node's own identity: a P-256 key made on the node and a certificate
request for CN = node id. The key never leaves the node; only the request
(and, back from the control plane, the certificate) travels."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .protocol import NODE_ID_RE


class IdentityError(Exception):
    pass


def key_ensure(path: Path, *, fresh: bool = False) -> ec.EllipticCurvePrivateKey:
    """The key at path; made (0600, by whoever runs this: root under the
    job) when missing or when a fresh one is asked for. An existing key is
    reused, so a rerun asks to sign the same key again."""
    if path.exists() and not fresh:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise IdentityError(f"{path} is not an EC private key")
        os.chmod(path, 0o600)
        return key
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    os.replace(tmp, path)
    return key


def csr_make(*, node_id: str, key: ec.EllipticCurvePrivateKey) -> bytes:
    if not NODE_ID_RE.match(node_id):
        raise IdentityError(f"{node_id!r} is not a valid node id")
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .sign(key, hashes.SHA256())
    )
    return request.public_bytes(serialization.Encoding.PEM)


def cert_window(cert_path: Path) -> tuple[float, float]:
    """(not_before, not_after) of the certificate, as Unix times."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    return cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp()


def renewal_due(cert_path: Path, now: float) -> bool:
    """Two thirds of the certificate's lifetime have passed."""
    try:
        start, end = cert_window(cert_path)
    except (OSError, ValueError):
        return False
    return now >= start + (end - start) * 2 / 3


def identity_replace(*, key_path: Path, cert_path: Path, key: ec.EllipticCurvePrivateKey, cert_pem: bytes) -> None:
    """Put a new key and its certificate in place of the old pair: both
    written beside their targets first, then renamed, key first."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    if cert.public_key().public_numbers() != key.public_key().public_numbers():
        raise IdentityError("the certificate the control plane sent is not for the key made here")
    new_key = key_path.with_name(key_path.name + ".new")
    key_ensure(new_key, fresh=True)  # 0600 before the real key is written into it
    new_key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    new_cert = cert_path.with_name(cert_path.name + ".new")
    new_cert.write_bytes(cert_pem)
    os.chmod(new_cert, 0o644)
    os.replace(new_key, key_path)
    os.replace(new_cert, cert_path)
