"""Reads for accounts: a user's role, a token's user."""

from __future__ import annotations

import hashlib
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.utils import timezone

from .models import OperatorToken
from .roles import ROLES

# last_used_at is written at most this often per token (not on every request).
LAST_USED_GRANULARITY = timedelta(seconds=60)


def token_hash(token: str) -> str:
    # Tokens are 40 random characters (238 bits): a fast hash is enough.
    return hashlib.sha256(token.encode()).hexdigest()


def token_row(*, token: str) -> OperatorToken | None:
    """The unexpired token row of an active user, or None."""
    row = OperatorToken.objects.select_related("user").filter(secret_hash=token_hash(token)).first()
    if row is None or not row.user.is_active:
        return None
    if row.expires_at is not None and row.expires_at <= timezone.now():
        return None
    return row


def token_list(*, user, everyone: bool = False):
    rows = OperatorToken.objects.select_related("user")
    return rows if everyone else rows.filter(user=user)


def token_use(*, token: str) -> OperatorToken | None:
    """The row of an unexpired token of an active user (its last use noted), or None."""
    row = token_row(token=token)
    if row is None:
        return None
    now = timezone.now()
    if row.last_used_at is None or now - row.last_used_at > LAST_USED_GRANULARITY:
        OperatorToken.objects.filter(pk=row.pk).update(last_used_at=now)
    return row


def token_user(*, token: str):
    """The active user whose unexpired token this is, or None."""
    row = token_use(token=token)
    return row.user if row is not None else None


def user_role(user) -> str | None:
    """The user's role (the highest of its role groups), None for none."""
    names = {group.name for group in user.groups.all()}
    for role in reversed(ROLES):
        if role in names:
            return role
    return None


def user_list():
    return get_user_model().objects.prefetch_related("groups").order_by("username")
