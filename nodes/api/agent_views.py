"""The agent API: plain Django views on the mTLS listener.

Plain views rather than DRF's: this path runs thousands of times a second, and
its input is validated only when a heartbeat brings news (see
``nodes.heartbeat``).
"""

import json
import logging

import redis
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, OperationalError
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from agent.protocol import NODE_ID_RE
from core import outages
from pki.authn import PeerIdentity, peer_identity
from pki.names import InvalidNodeId, validate_node_id
from pki.selectors import revoked_serials
from pki.services import PkiError
from pki.signing import RenewalTooSoon

from ..certificates import cert_renew_node

from .. import selectors
from ..exceptions import InventoryRejected
from ..heartbeat import node_heartbeat, node_heartbeat_unchanged
from ..models import Node
from ..validation import HeartbeatInvalid
from ..longpoll import LongPollInvalid, longpoll_params

logger = logging.getLogger(__name__)


def _error(status: int, message: str, **extra) -> JsonResponse:
    return JsonResponse({"error": message, **extra}, status=status)


def _unavailable(exc: Exception, node_id: str) -> JsonResponse:
    """503 for a dependency that is away (the agent retries soon, without
    backing off); anything else is a bug and is raised as such."""
    dependency = outages.dependency_failed(exc)
    if dependency is None:
        raise exc
    # Said once when the dependency went away (core.outages); not once per request.
    logger.debug("agent-api answered 503 node=%s dependency=%s", node_id, dependency)
    response = _error(503, outages.unavailable_message(dependency, exc), dependency=dependency)
    response["Retry-After"] = str(outages.RETRY_AFTER)
    return response


def authorize_node(request, node_id: str) -> JsonResponse | None:
    """None if the verified client certificate proves ``node_id``; else the refusal."""
    peer = peer_identity(request.META)
    if peer is None:
        # Only reachable when the listener was started without client
        # certificates required: refuse rather than trust a URL.
        logger.error("agent-api refused node=%s: no verified client certificate", node_id)
        return _error(403, "no verified client certificate; the agent API requires mTLS")
    if peer.common_name != node_id:
        logger.warning(
            "agent-api refused: certificate cn=%s serial=%s used for node=%s",
            peer.common_name, peer.serial, node_id,
        )
        return _error(
            403,
            f"this certificate is for node {peer.common_name!r}, not {node_id!r}: a node can only "
            "speak for itself. Issue a certificate for this node with "
            f"'llmgw ctl cert issue-client {node_id}'",
        )
    try:
        revoked = revoked_serials.get()
    except DatabaseError as exc:
        # No copy of the revocations at all yet: a revoked certificate cannot be told from a good one.
        return _unavailable(exc, node_id)
    if peer.serial in revoked:
        logger.warning("agent-api refused: revoked certificate cn=%s serial=%s", peer.common_name, peer.serial)
        return _error(
            403,
            f"certificate {peer.serial} for node {node_id} has been revoked; issue a new one with "
            f"'llmgw ctl cert issue-client {node_id}'",
        )
    return None


@csrf_exempt
def ping(request):
    """A no-op behind the same TLS and identity checks: the floor of what any
    agent API request costs (bench/heartbeats.py measures against it)."""
    peer = peer_identity(request.META)
    return JsonResponse({"ok": True, "cn": peer.common_name if peer else None})


# --- the quick lane: the same 200s, for the agent API's event loop -------------------


def _json_bytes(data) -> bytes:
    """The body ``JsonResponse(data)`` carries."""
    return json.dumps(data, cls=DjangoJSONEncoder).encode()


def ping_quick(*, peer: PeerIdentity) -> bytes:
    """The body ``ping`` answers a verified peer with."""
    return _json_bytes({"ok": True, "cn": peer.common_name})


def heartbeat_quick(*, node_id: str, peer: PeerIdentity, body: bytes) -> bytes | None:
    """The body of the 200 ``heartbeat`` would answer a heartbeat that brings
    no news with, its liveness recorded; None, with nothing recorded, for
    anything else (a refusal, news, a copy of the revoked serials that
    ``authorize_node`` would re-read first): the view then answers it. Never
    any I/O: ``agentapi.quick`` calls it in the listener's event loop."""
    if peer.common_name != node_id or not NODE_ID_RE.match(node_id):
        return None
    revoked = revoked_serials.fresh()
    if revoked is None or peer.serial in revoked or len(body) > settings.LLMGW_MAX_HEARTBEAT_BYTES:
        return None
    return node_heartbeat_unchanged(node_name=node_id, body=body, encode=_json_bytes)


def _read_body(request) -> tuple[bytes, JsonResponse | None]:
    """The request body, refused if over ``LLMGW_MAX_HEARTBEAT_BYTES``.

    A declared length is checked before reading anything. A chunked body has
    none (and Django would read it as empty): read at most one byte past the
    limit from the server's de-chunking input stream.
    """
    limit = settings.LLMGW_MAX_HEARTBEAT_BYTES
    too_big = f"heartbeat is over the limit of {limit} bytes; nothing was stored"
    if "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower():
        body = request.environ["wsgi.input"].read(limit + 1)
        if len(body) > limit:
            return b"", _error(413, too_big)
        return body, None
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return b"", _error(400, "the Content-Length header is not a number")
    if length > limit:
        return b"", _error(413, f"heartbeat of {length} bytes is over the limit of {limit}; nothing was stored")
    try:
        return request.body, None
    except RequestDataTooBig:
        return b"", _error(413, too_big)


def _node_json(request, node_id: str, what: str):
    """The JSON object a node posted about itself: (payload, None), or (None,
    the refusal): a bad node id, a certificate that is not this node's, a
    body too large or not a JSON object."""
    try:
        validate_node_id(node_id)
    except InvalidNodeId as exc:
        return None, _error(400, str(exc))
    refusal = authorize_node(request, node_id)
    if refusal is not None:
        return None, refusal
    body, refusal = _read_body(request)
    if refusal is not None:
        return None, refusal
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, _error(400, f"the body is not valid JSON: {exc}")
    except RecursionError:
        return None, _error(400, "the body is not valid JSON: nested too deeply")
    if not isinstance(payload, dict):
        return None, _error(400, f"the body must be a JSON object ({what})")
    return payload, None


@csrf_exempt
@require_POST
def heartbeat(request, node_id: str):
    payload, refusal = _node_json(request, node_id, "see agent.protocol.Heartbeat")
    if refusal is not None:
        return refusal
    try:
        reply = node_heartbeat(node_name=node_id, payload=payload)
    except (DatabaseError, redis.RedisError) as exc:
        return _unavailable(exc, node_id)
    except HeartbeatInvalid as exc:
        logger.warning("agent-api heartbeat rejected node=%s errors=%s", node_id, exc.errors)
        return _error(400, "invalid heartbeat; nothing was stored", details=exc.errors)
    except InventoryRejected as exc:
        logger.warning("agent-api heartbeat rejected node=%s %s", node_id, exc)
        return _error(409, f"{exc}; nothing was stored")
    return JsonResponse(reply)


@csrf_exempt
@require_POST
def certificate(request, node_id: str):
    """Rotation: the node's next certificate, asked for over its current one
    with a request for a fresh key made on the node."""
    payload, refusal = _node_json(request, node_id, '{"csr": "<PEM request>"}')
    if refusal is not None:
        return refusal
    csr = payload.get("csr")
    if not isinstance(csr, str):
        return _error(400, 'the body must be JSON {"csr": "<PEM request>"}: csr is missing or not a string',
                      details={"csr": ["a PEM certificate request, as a string"]})
    try:
        signed = cert_renew_node(node_id=node_id, csr_pem=csr, current_serial=peer_identity(request.META).serial)
    except RenewalTooSoon as exc:
        logger.warning("agent-api certificate renewal too soon node=%s: %s", node_id, exc)
        response = _error(429, f"{exc}; nothing was signed")
        response["Retry-After"] = str(exc.retry_after)
        return response
    except PkiError as exc:
        logger.warning("agent-api certificate renewal refused node=%s: %s", node_id, exc)
        return _error(400, f"{exc}; nothing was signed")
    return JsonResponse({"certificate": signed.cert_pem.decode(), "serial": signed.row.serial,
                         "not_after": signed.row.not_after.isoformat()})


@csrf_exempt
@require_GET
def desired(request, node_id: str):
    """The node's desired state. Long-polls that have nothing new yet were
    parked by the listener before reaching this view (agentapi.parking),
    so it always answers at once."""
    refusal = authorize_node(request, node_id)
    if refusal is not None:
        return refusal
    try:
        longpoll_params(version=request.GET.get("version"), wait=request.GET.get("wait"))
    except LongPollInvalid as exc:
        return _error(400, str(exc), details={exc.field: [str(exc)]})
    try:
        if not outages.database_dependency.worth_trying():
            raise OperationalError(f"the database is unreachable ({outages.database_dependency.cause})")
        version = Node.objects.filter(name=node_id).values_list("desired_version", flat=True).first()
        if version is None:
            return _error(404, f"node {node_id} has not registered yet: send a heartbeat first")
        return JsonResponse(selectors.node_desired_state(node_name=node_id, version=version))
    except DatabaseError as exc:
        return _unavailable(exc, node_id)
