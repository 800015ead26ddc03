"""Writes for accounts: users with a role, operator tokens."""

from __future__ import annotations

import logging
import secrets
import string
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from core.choices import EventSeverity
from core.events import event_record
from core.exceptions import NotFound

from .choices import AccountEventKind

from .models import OperatorToken
from .roles import ADMIN, ROLES, roles_sync
from .selectors import token_hash, user_role

logger = logging.getLogger(__name__)

TOKEN_PREFIX = "llmgw-op-"
TOKEN_DEFAULT_DAYS = 90
TOKEN_MAX_DAYS = 366
_ALPHABET = string.ascii_letters + string.digits
_SHOWN = 8


@dataclass(frozen=True)
class CreatedToken:
    row: OperatorToken
    token: str  # the only time the token itself exists outside its holder's hands


def token_create(*, user, name: str = "", days: float | None = None, not_after=None,
                 actor: str = "") -> CreatedToken:
    """A token acting as ``user`` with the user's role, valid ``days`` days
    (None: without end, only for the token 'llmgw up' writes), and never past
    ``not_after`` (the expiry of the token that asked for it: a token cannot
    outlive the one that made it)."""
    expires_at = token_expiry(days=days, not_after=not_after)
    for _ in range(5):
        token = TOKEN_PREFIX + "".join(secrets.choice(_ALPHABET) for _ in range(40))
        try:
            with transaction.atomic():
                row = OperatorToken.objects.create(
                    user=user, name=name, prefix=token[: len(TOKEN_PREFIX) + _SHOWN], secret_hash=token_hash(token),
                    expires_at=expires_at,
                )
        except IntegrityError:
            continue  # the prefix collided: draw again
        logger.info("operator token created user=%s prefix=%s", user.username, row.prefix)
        if actor:
            until = f"until {expires_at:%Y-%m-%d %H:%M} UTC" if expires_at else "without expiry"
            _record(username=user.username, actor=actor, token=row.prefix,
                    message=f"operator token {row.prefix} ({name or 'unnamed'}) of {user.username} made by {actor}, "
                            f"{until}")
        return CreatedToken(row=row, token=token)
    raise RuntimeError("could not draw an unused token prefix")


def token_expiry(*, days: float | None, not_after=None):
    """When a token made now for ``days`` days expires (a pure decision)."""
    if days is not None and not 0 < days <= TOKEN_MAX_DAYS:
        raise ValidationError({"days": f"a token lives more than 0 and at most {TOKEN_MAX_DAYS} days"})
    expires_at = timezone.now() + timedelta(days=days) if days is not None else None
    if not_after is not None and (expires_at is None or expires_at > not_after):
        expires_at = not_after
    return expires_at


def token_revoke(*, prefix: str, user, actor: str) -> OperatorToken:
    """Revoke (delete) a token: one's own, or anyone's with
    ``accounts.delete_operatortoken`` (admins)."""
    with transaction.atomic():
        row = OperatorToken.objects.select_related("user").select_for_update().filter(prefix=prefix).first()
        if row is None or (row.user_id != user.pk and not user.has_perm("accounts.delete_operatortoken")):
            # Someone else's token is as absent as one that does not exist.
            raise NotFound(f"no token {prefix!r} of yours; 'llmgw ctl tokens list' lists them")
        row.delete()
        _record(username=row.user.username, actor=actor, token=prefix,
                message=f"operator token {prefix} of {row.user.username} revoked by {actor}")
    logger.info("operator token revoked user=%s prefix=%s actor=%s", row.user.username, prefix, actor)
    return row


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValidationError({"role": f"{role!r} is not a role; the roles are {', '.join(ROLES)}"})


def _apply_role(user, role: str) -> None:
    user.groups.remove(*Group.objects.filter(name__in=ROLES))
    group = Group.objects.filter(name=role).first()
    if group is None:  # a database flushed without its post_migrate (some test setups)
        roles_sync(group_model=Group, permission_model=Permission)
        group = Group.objects.get(name=role)
    user.groups.add(group)
    # The Django admin is for admins; the others use the pages and the API.
    if user.is_staff != (role == ADMIN) and not user.is_superuser:
        user.is_staff = role == ADMIN
        user.save(update_fields=["is_staff"])


def _record(*, username: str, actor: str, message: str, **data) -> None:
    event_record(kind=AccountEventKind.ACCOUNT, subject=f"user/{username}", severity=EventSeverity.WARNING
                 if data.get("warning") else EventSeverity.INFO, message=message,
                 data={"actor": actor, **{k: v for k, v in data.items() if k != "warning"}})


def user_create(*, username: str, role: str, actor: str, password: str | None = None) -> tuple[object, str | None]:
    """A new user with a role; returns (user, the generated password or None when one was given)."""
    _check_role(role)
    User = get_user_model()
    generated = None
    if password is None:
        generated = password = secrets.token_urlsafe(15)
    try:
        User.username_validator(username)
    except ValidationError as exc:
        raise ValidationError({"username": exc.messages}) from None
    try:
        # With the user's own name: a password like the name is refused too.
        validate_password(password, user=User(username=username))
    except ValidationError as exc:
        raise ValidationError({"password": exc.messages}) from None
    with transaction.atomic():
        if User.objects.filter(username=username).exists():
            raise ValidationError({"username": f"a user named {username!r} exists already; use set-role"})
        user = User.objects.create_user(username=username, password=password)
        _apply_role(user, role)
        _record(username=username, actor=actor, role=role, message=f"user {username} created by {actor} as {role}")
    logger.info("user created username=%s role=%s actor=%s", username, role, actor)
    return user, generated


def user_set_role(*, username: str, role: str, actor: str):
    _check_role(role)
    User = get_user_model()
    with transaction.atomic():
        user = User.objects.select_for_update().filter(username=username).first()
        if user is None:
            raise NotFound(f"no user named {username!r}")
        before = user_role(user)
        _apply_role(user, role)
        if before != role:
            _record(username=username, actor=actor, role=role, previous=before, warning=role == ADMIN,
                    message=f"user {username}'s role changed by {actor}: {before or 'none'} -> {role}")
    logger.info("user role set username=%s role=%s actor=%s", username, role, actor)
    return user


def user_set_superuser(*, username: str, superuser: bool, actor: str):
    """Grant or take back superuser (every action, including those mapped to
    no permission). Callers check that ``actor`` is a superuser itself: the
    REST action maps no permission, so only superusers reach it."""
    User = get_user_model()
    with transaction.atomic():
        user = User.objects.select_for_update().filter(username=username).first()
        if user is None:
            raise NotFound(f"no user named {username!r}")
        if user.is_superuser == superuser:
            return user
        user.is_superuser = superuser
        # A superuser is staff (the Django admin); taking it back leaves staff to the role.
        user.is_staff = superuser or user_role(user) == ADMIN
        user.save(update_fields=["is_superuser", "is_staff"])
        verb = "granted superuser" if superuser else "no longer superuser"
        _record(username=username, actor=actor, superuser=superuser, warning=superuser,
                message=f"user {username} {verb} by {actor}")
    logger.warning("user superuser set username=%s superuser=%s actor=%s", username, superuser, actor)
    return user
