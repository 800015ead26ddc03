"""Writes for accounts: users with a role, operator tokens."""

from __future__ import annotations

import logging
import secrets
import string
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from core.exceptions import NotFound

from .models import OperatorToken
from .roles import ADMIN, ROLES, roles_sync
from .selectors import token_hash

logger = logging.getLogger(__name__)

TOKEN_PREFIX = "llmgw-op-"
_ALPHABET = string.ascii_letters + string.digits
_SHOWN = 8


@dataclass(frozen=True)
class CreatedToken:
    row: OperatorToken
    token: str  # the only time the token itself exists outside its holder's hands


def token_create(*, user, name: str = "") -> CreatedToken:
    for _ in range(5):
        token = TOKEN_PREFIX + "".join(secrets.choice(_ALPHABET) for _ in range(40))
        try:
            with transaction.atomic():
                row = OperatorToken.objects.create(
                    user=user, name=name, prefix=token[: len(TOKEN_PREFIX) + _SHOWN], secret_hash=token_hash(token)
                )
        except IntegrityError:
            continue  # the prefix collided: draw again
        logger.info("operator token created user=%s prefix=%s", user.username, row.prefix)
        return CreatedToken(row=row, token=token)
    raise RuntimeError("could not draw an unused token prefix")


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


def user_create(*, username: str, role: str, password: str | None = None) -> tuple[object, str | None]:
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
        validate_password(password)
    except ValidationError as exc:
        raise ValidationError({"password": exc.messages}) from None
    with transaction.atomic():
        if User.objects.filter(username=username).exists():
            raise ValidationError({"username": f"a user named {username!r} exists already; use set-role"})
        user = User.objects.create_user(username=username, password=password)
        _apply_role(user, role)
    logger.info("user created username=%s role=%s", username, role)
    return user, generated


def user_set_role(*, username: str, role: str):
    _check_role(role)
    User = get_user_model()
    with transaction.atomic():
        user = User.objects.select_for_update().filter(username=username).first()
        if user is None:
            raise NotFound(f"no user named {username!r}")
        _apply_role(user, role)
    logger.info("user role set username=%s role=%s", username, role)
    return user
