"""The desired-state long-poll, without a thread per waiting agent.

An agent asks ``GET /agent/v1/nodes/<id>/desired?version=N&wait=S``. When
version N is current, the agent API worker parks the connection in its event
loop (see ``agentapi.watch``) instead of holding a pool thread for up
to S seconds, and wakes it when the node's state changes: services publish
the node's name on a Redis channel (``liveness.RedisLiveness.bump_many``),
or, on the embedded default, a poller reads the waiting nodes' versions from
the database.

This module decides whether a request may be parked; the answer itself always
comes from the Django view, so refusals and replies have one implementation.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from urllib.parse import parse_qs

from django.conf import settings
from django.db import DatabaseError, close_old_connections

from agent.protocol import API_PREFIX
from pki.authn import identity_from_der
from pki.selectors import revoked_serials

from . import outages
from .models import Node

logger = logging.getLogger(__name__)

CHANNEL = "llmgw:nodes:changed"
MAX_WAIT = 60.0
PATH_RE = re.compile(rf"^{re.escape(API_PREFIX)}/nodes/(?P<node>[^/]+)/desired$")


@dataclass(frozen=True)
class Parkable:
    node: str
    version: int
    wait: float


def parkable(*, method: str, path: str, query: str, peer_der: bytes | None) -> Parkable | None:
    """A long-poll that has nothing to say yet, from the node it names.

    Anything else (other paths, bad parameters, a foreign or revoked
    certificate, a version that is already stale) returns None and goes to
    the view, which answers at once.
    """
    if method != "GET":
        return None
    match = PATH_RE.match(path)
    if match is None or not peer_der:
        return None
    params = parse_qs(query)
    try:
        version = int(params["version"][0])
        wait = min(float(params.get("wait", ["0"])[0]), MAX_WAIT)
    except (KeyError, ValueError, IndexError):
        return None
    if wait <= 0:
        return None
    node = match["node"]
    peer = identity_from_der(peer_der)
    if not outages.database_dependency.worth_trying():
        return None  # known to be away: the view answers 503 at once
    try:
        if peer.common_name != node or peer.serial in revoked_serials.get():
            return None
        current = Node.objects.filter(name=node).values_list("desired_version", flat=True).first()
    except DatabaseError:
        return None  # the database is away: the view answers 503 at once
    finally:
        # A parked request never reaches Django's end of request: give the
        # connection back to the pool now, or this idle thread keeps it.
        close_old_connections()
    if current is None or current != version:
        return None
    return Parkable(node=node, version=version, wait=wait)


def versions(nodes: list[str]) -> dict[str, int]:
    return dict(Node.objects.filter(name__in=nodes).values_list("name", "desired_version"))


def use_pubsub() -> bool:
    return bool(settings.LLMGW_REDIS_URL)
