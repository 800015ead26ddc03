"""Who is on the other end of an agent API connection.

The TLS layer (see ``agentapi.worker``) has already verified the
client's certificate against our authority, its validity period and its
clientAuth usage; here we read the verified certificate off the socket and
name the node it proves.
"""

from dataclasses import dataclass
from functools import lru_cache

from cryptography import x509
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class PeerIdentity:
    common_name: str
    serial: str


@lru_cache(maxsize=16384)
def identity_from_der(der: bytes) -> PeerIdentity:
    cert = x509.load_der_x509_certificate(der)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return PeerIdentity(
        common_name=names[0].value if names else "",
        serial=format(cert.serial_number, "x"),
    )


def peer_identity(meta) -> PeerIdentity | None:
    """The verified peer of a request served by our gunicorn TLS listener."""
    sock = meta.get("gunicorn.socket")
    getpeercert = getattr(sock, "getpeercert", None)
    if getpeercert is None:
        return None
    der = getpeercert(binary_form=True)
    if not der:
        return None
    return identity_from_der(der)
