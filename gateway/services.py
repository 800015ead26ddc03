"""Writes for the gateway: API keys, their usage, and each process's record
(published, forgotten, and pruned when its process is long gone)."""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import secrets
import string
from dataclasses import dataclass
from typing import Any

from django.conf import settings as site_settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.utils import timezone

from core.choices import CoreEventKind
from core.events import event_record
from core.exceptions import NotFound
from replicas.models import CatalogEntry

from . import inflight
from .choices import Priority
from .models import KEY_NAME, ApiKey, KeyUsage

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


# What an operator may set on a key besides its models (gateway/limits.py, gateway/queue.py).
LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "daily_tokens", "monthly_tokens")
SETTINGS_FIELDS = (*LIMIT_FIELDS, "expires_at", "priority")


def key_settings_validate(settings: dict[str, Any]) -> dict[str, Any]:
    """The limits, expiry and priority given, checked: each limit a positive whole number or None (no
    limit), the priority one of the classes, the expiry a time (in the past: the key stops working)."""
    unknown = sorted(set(settings) - set(SETTINGS_FIELDS))
    if unknown:
        raise ValidationError(f"unknown key setting(s): {', '.join(unknown)}; known: {', '.join(SETTINGS_FIELDS)}")
    for field in LIMIT_FIELDS:
        value = settings.get(field)
        if value is not None and (type(value) is not int or value <= 0):
            raise ValidationError(f"{field} must be a positive whole number, or null for no limit (got {value!r})")
    priority = settings.get("priority")
    if "priority" in settings and priority not in Priority.values:
        raise ValidationError(f"priority must be one of {', '.join(Priority.values)} (got {priority!r})")
    expires = settings.get("expires_at")
    if expires is not None and (not isinstance(expires, dt.datetime) or timezone.is_naive(expires)):
        raise ValidationError("expires_at must be a time with its timezone (ISO 8601, e.g. 2027-01-31T00:00:00Z)")
    return settings


def key_defaults() -> dict[str, Any]:
    """What a new key gets for each setting its creator does not give: the deployment's
    LLMGW_KEYS_DEFAULT_* (0: no limit, never expires). Written on the key, not looked up when it is
    used, so that the keys' list shows what each has and a default changed later leaves them as they are."""
    defaults: dict[str, Any] = {
        field: getattr(site_settings, f"LLMGW_KEYS_DEFAULT_{field.upper()}") or None for field in LIMIT_FIELDS}
    days = site_settings.LLMGW_KEYS_DEFAULT_EXPIRES_DAYS
    defaults["expires_at"] = timezone.now() + dt.timedelta(days=days) if days else None
    defaults["priority"] = site_settings.LLMGW_KEYS_DEFAULT_PRIORITY
    return defaults


def key_create(*, name: str, models: list[str] | None = None, actor: str = "", **settings: Any) -> CreatedKey:
    """A new key, optionally restricted to some catalog models, with limits, an expiry and a priority
    (``SETTINGS_FIELDS``; one not given takes the deployment's default, None is no limit or no expiry
    whatever the default). ``actor`` (who asked) goes into the Event."""
    KEY_NAME(name)
    key_settings_validate(settings)
    settings = {**key_defaults(), **settings}
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
                    name=name, prefix=key[: len(KEY_PREFIX) + _SHOWN], secret_hash=key_hash(key),
                    allowed_models=allowed, **settings,
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


def key_update(*, name: str, actor: str = "", **settings: Any) -> ApiKey:
    """Change a key's limits, expiry or priority (only those given; None removes a limit or the
    expiry). Every gateway applies the change within a second; counts already made stay."""
    key_settings_validate(settings)
    with transaction.atomic():
        row = ApiKey.objects.select_for_update().filter(name=name).first()
        if row is None:
            raise NotFound(f"no API key named {name!r}")
        changed = {f: v for f, v in settings.items() if getattr(row, f) != v}
        if changed:
            for field, value in changed.items():
                setattr(row, field, value)
            row.save(update_fields=[*changed, "updated_at"])
            shown = {f: (v.isoformat() if isinstance(v, dt.datetime) else v) for f, v in changed.items()}
            event_record(kind=CoreEventKind.CONTROL_PLANE, subject=f"apikey/{name}",
                         message=f"API key {name} changed by {actor or 'an operator'}: "
                                 + ", ".join(f"{f}={v}" for f, v in shown.items()),
                         data={"actor": actor, "changed": shown})
            logger.info("api key updated name=%s %s", name, " ".join(f"{f}={v}" for f, v in shown.items()))
    return row


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
    with transaction.atomic():
        for key_id, (requests, prompt, completion) in sorted(usage.items()):
            ApiKey.objects.filter(pk=key_id).update(
                requests=F("requests") + requests,
                prompt_tokens=F("prompt_tokens") + prompt,
                completion_tokens=F("completion_tokens") + completion,
                last_used_at=now,
            )


def key_usage_hours_add(*, usage: dict[tuple[int, str, int], tuple[int, int, int]]) -> None:
    """Add a batch of hourly usage: (key id, model, unix hour) -> (requests, prompt, completion tokens).
    One upsert per row, adding to what other gateway processes wrote (INSERT ... ON CONFLICT, which
    PostgreSQL and SQLite both have); rows of keys deleted meanwhile are dropped."""
    if not usage:
        return
    table = connection.ops.quote_name(KeyUsage._meta.db_table)
    live = set(ApiKey.objects.filter(pk__in={k for k, _, _ in usage}).values_list("pk", flat=True))
    sql = (f"INSERT INTO {table} (key_id, model, hour, requests, prompt_tokens, completion_tokens) "
           f"VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (key_id, model, hour) DO UPDATE SET "
           f"requests = {table}.requests + excluded.requests, "
           f"prompt_tokens = {table}.prompt_tokens + excluded.prompt_tokens, "
           f"completion_tokens = {table}.completion_tokens + excluded.completion_tokens")
    adapt = connection.ops.adapt_datetimefield_value
    rows = [(key_id, model, adapt(dt.datetime.fromtimestamp(hour * 3600, tz=dt.timezone.utc)), *counts)
            for (key_id, model, hour), counts in sorted(usage.items()) if key_id in live]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.executemany(sql, rows)


def key_usage_flush(*, usage: dict[int, tuple[int, int, int]],
                    hours: dict[tuple[int, str, int], tuple[int, int, int]]) -> None:
    """A gateway process's batch of both, in one transaction: written whole or not at all."""
    with transaction.atomic():
        key_usage_add(usage=usage)
        key_usage_hours_add(usage=hours)


def gateway_process_publish(*, name: str, routes: list[int], inflight_counts: dict[int, int]) -> None:
    inflight.store().publish(name=name, routes=routes, inflight=inflight_counts)


def gateway_process_exchange(*, name: str, routes: list[int], inflight_counts: dict[int, int],
                             wants: dict[int, tuple[int, int, int]]) -> inflight.Shares:
    """Publish this process's record and take its batch ceilings (Redis only: gateway.inflight.EXCHANGE)."""
    return inflight.store().exchange(name=name, routes=routes, inflight=inflight_counts, wants=wants)


def gateway_process_forget(*, name: str) -> None:
    inflight.store().forget(name)


def gateway_processes_prune() -> int:
    """Delete the records of processes gone for longer than
    ``inflight.FORGET_AFTER`` (and unreadable ones); return how many."""
    return inflight.store().prune()
