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
import math
import re
from dataclasses import dataclass
from urllib.parse import parse_qs

from django.conf import settings
from django.db import DatabaseError, close_old_connections

from agent.protocol import API_PREFIX
from core import outages
from pki.authn import identity_from_der
from pki.selectors import revoked_serials

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


class LongPollInvalid(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def longpoll_params(*, version: str | None, wait: str | None) -> tuple[int | None, float]:
    """The ``version`` and ``wait`` of a desired-state request, or
    ``LongPollInvalid`` naming the field at fault. A wait over ``MAX_WAIT``
    is cut to it: a long-poll may always be answered early."""
    parsed_version = None
    if version is not None:
        try:
            parsed_version = int(version)
        except ValueError:
            parsed_version = -1
        if parsed_version < 0:
            raise LongPollInvalid("version", f"version must be a whole number of 0 or more, not {version[:40]!r}")
    if wait is None:
        return parsed_version, 0.0
    try:
        seconds = float(wait)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise LongPollInvalid(
            "wait", f"wait must be a number of seconds from 0 to {MAX_WAIT:g}, not {wait[:40]!r}"
        )
    return parsed_version, min(seconds, MAX_WAIT)


def parkable(*, method: str, path: str, query: str, peer_der: bytes | None) -> Parkable | None:
    """A long-poll that has nothing to say yet, from the node it names.

    Anything else (other paths, bad parameters: the view answers them 400, a foreign or revoked
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
        # The last of repeated parameters, as the view reads them (QueryDict).
        version, wait = longpoll_params(
            version=params.get("version", [None])[-1], wait=params.get("wait", [None])[-1]
        )
    except LongPollInvalid:
        return None
    if version is None or wait <= 0:
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
    # Read by tests: from this line on, a change of this node wakes the request
    # (the worker compares the change's time with the moment this check began).
    logger.debug("long-poll parked node=%s version=%s wait=%gs", node, version, wait)
    return Parkable(node=node, version=version, wait=wait)


def versions(nodes: list[str]) -> dict[str, int]:
    return dict(Node.objects.filter(name__in=nodes).values_list("name", "desired_version"))


def use_pubsub() -> bool:
    return bool(settings.LLMGW_REDIS_URL)
