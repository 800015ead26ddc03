"""The agent API's heartbeat view called in-process, as the listener calls it.

The view reads the verified peer certificate off the TLS socket gunicorn
hands it (``request.META["gunicorn.socket"]``). Here the socket is an object
offering the same ``getpeercert``, holding a real certificate issued by the
test authority: the identity checks run as they do over TLS, without a
handshake per example (tests/nodes/test_agent_api.py covers the real wire).
"""

from __future__ import annotations

import json
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from django.test import RequestFactory

from nodes.api import agent_views
from pki import services as pki_services


class PeerSocket:
    def __init__(self, der: bytes) -> None:
        self.der = der

    def getpeercert(self, binary_form: bool = False) -> bytes:
        return self.der


def peer_for(node_id: str) -> PeerSocket:
    """A socket whose verified peer is a fresh certificate for ``node_id``."""
    issued = pki_services.cert_issue_client(node_id=node_id)
    cert = x509.load_pem_x509_certificate(issued.cert_pem)
    return PeerSocket(cert.public_bytes(serialization.Encoding.DER))


def send_heartbeat(peer: PeerSocket, node_id: str, body: Any) -> tuple[int, dict[str, Any]]:
    """(status, decoded JSON answer) of one heartbeat; ``body`` is bytes or a JSON value."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = RequestFactory().post(
        f"/agent/v1/nodes/{node_id}/heartbeat", data=content, content_type="application/json",
        **{"gunicorn.socket": peer},
    )
    response = agent_views.heartbeat(request, node_id=node_id)
    return response.status_code, json.loads(response.content)
