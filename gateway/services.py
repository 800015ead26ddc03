"""Writes for the gateway: API keys, their usage, and each process's record
(published, forgotten, and pruned when its process is long gone)."""

from __future__ import annotations

import hashlib
import logging
import secrets
import string
from dataclasses import dataclass

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from core.choices import CoreEventKind
from core.events import event_record
from core.exceptions import NotFound
from replicas.models import CatalogEntry

from . import inflight
from .models import KEY_NAME, ApiKey

logger = logging.getLogger(__name__)

KEY_PREFIX = "sk-llmgw-"
_ALPHABET = string.ascii_letters + string.digits
# Characters after KEY_PREFIX that are kept (and shown) as the key's prefix.
_SHOWN = 8


def key_hash(key: str) -> str:
    # The keys are 40 random characters (238 bits): a fast hash is enough,
    # and the gateway computes it on every request.
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class CreatedKey:
    row: ApiKey
    key: str  # the only time the key itself exists outside its holder's hands


def key_create(*, name: str, models: list[str] | None = None, actor: str = "") -> CreatedKey:
    """A new key, optionally restricted to some catalog models. ``actor`` (who
    asked) goes into the Event."""
    KEY_NAME(name)
    allowed = sorted({m.strip() for m in models or [] if m.strip()})
    if allowed:
        known = set(CatalogEntry.objects.filter(name__in=allowed).values_list("name", flat=True))
        unknown = [m for m in allowed if m not in known]
        if unknown:
            catalog = ", ".join(CatalogEntry.objects.values_list("name", flat=True)) or "nothing yet"
            raise ValidationError(f"no such model in the catalog: {', '.join(unknown)} (the catalog has: {catalog})")
    if ApiKey.objects.filter(name=name).exists():
        raise ValidationError(f"a key named {name!r} exists already; revoke it or choose another name")
    for _ in range(5):
        key = KEY_PREFIX + "".join(secrets.choice(_ALPHABET) for _ in range(40))
        try:
            with transaction.atomic():
                row = ApiKey.objects.create(
                    name=name, prefix=key[: len(KEY_PREFIX) + _SHOWN], secret_hash=key_hash(key), allowed_models=allowed
                )
                event_record(kind=CoreEventKind.CONTROL_PLANE, subject=f"apikey/{name}",
                             message=f"API key {name} ({row.prefix}...) created by {actor or 'an operator'}",
                             data={"actor": actor} if actor else None)
        except IntegrityError:
            if ApiKey.objects.filter(name=name).exists():
                raise ValidationError(f"a key named {name!r} exists already") from None
            continue  # the prefix collided: draw again
        logger.info("api key created name=%s prefix=%s models=%s", name, row.prefix, ",".join(allowed) or "*")
        return CreatedKey(row=row, key=key)
    raise RuntimeError("could not draw an unused key prefix")


def key_revoke(*, name: str, actor: str = "") -> ApiKey:
    """Revoke a key; every gateway refuses it within a second. Idempotent."""
    with transaction.atomic():
        row = ApiKey.objects.select_for_update().filter(name=name).first()
        if row is None:
            raise NotFound(f"no API key named {name!r}")
        if row.revoked_at is None:
            row.revoked_at = timezone.now()
            row.save(update_fields=["revoked_at", "updated_at"])
            event_record(kind=CoreEventKind.CONTROL_PLANE, subject=f"apikey/{name}",
                         message=f"API key {name} revoked by {actor or 'an operator'}",
                         data={"actor": actor} if actor else None)
            logger.info("api key revoked name=%s prefix=%s", name, row.prefix)
    return row


def key_usage_add(*, usage: dict[int, tuple[int, int, int]]) -> None:
    """Add a batch of usage: key id -> (requests, prompt tokens, completion tokens)."""
    now = timezone.now()
    for key_id, (requests, prompt, completion) in sorted(usage.items()):
        ApiKey.objects.filter(pk=key_id).update(
            requests=F("requests") + requests,
            prompt_tokens=F("prompt_tokens") + prompt,
            completion_tokens=F("completion_tokens") + completion,
            last_used_at=now,
        )


def gateway_process_publish(*, name: str, routes: list[int], inflight_counts: dict[int, int]) -> None:
    inflight.store().publish(name=name, routes=routes, inflight=inflight_counts)


def gateway_process_forget(*, name: str) -> None:
    inflight.store().forget(name)


def gateway_processes_prune() -> int:
    """Delete the records of processes gone for longer than
    ``inflight.FORGET_AFTER`` (and unreadable ones); return how many."""
    return inflight.store().prune()
