"""Operator tokens: kept as a hash, shown by prefix, converted from DRF's clear authtoken table."""

from __future__ import annotations

import hashlib
import importlib

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from rest_framework.test import APIClient

from accounts.models import OperatorToken
from accounts.services import token_create

pytestmark = pytest.mark.django_db


def test_a_token_is_stored_as_its_hash_and_works_as_token_or_bearer(admin_user):
    created = token_create(user=admin_user, name="ci")
    row = OperatorToken.objects.get()
    assert created.token not in {row.prefix, row.secret_hash, row.name}
    assert created.token.startswith(row.prefix) and row.secret_hash == hashlib.sha256(created.token.encode()).hexdigest()
    assert row.last_used_at is None
    for scheme in ("Token", "Bearer"):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"{scheme} {created.token}")
        assert client.get("/api/v1/nodes/").status_code == 200
    row.refresh_from_db()
    assert row.last_used_at is not None
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {row.secret_hash}")  # the hash is no token
    assert client.get("/api/v1/nodes/").status_code == 401


def test_an_inactive_users_token_is_refused(admin_user):
    token = token_create(user=admin_user).token
    admin_user.is_active = False
    admin_user.save()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/v1/nodes/").status_code == 401


def test_the_admin_shows_the_prefix_never_the_token(admin_client, admin_user):
    created = token_create(user=admin_user, name="ci")
    listing = admin_client.get("/admin/accounts/operatortoken/")
    assert listing.status_code == 200
    page = listing.content.decode()
    assert created.row.prefix in page
    assert created.token not in page and created.row.secret_hash not in page
    detail = admin_client.get(f"/admin/accounts/operatortoken/{created.row.pk}/change/").content.decode()
    assert created.token not in detail and created.row.secret_hash not in detail


def test_clear_authtoken_rows_become_hashed_tokens_that_still_work(django_db_blocker):
    """What an existing installation had (rest_framework.authtoken): its
    tokens keep working, and the clear table is gone."""
    user = get_user_model().objects.create_user("old-operator", password="x", is_superuser=True)
    legacy = "0123456789abcdef0123456789abcdef01234567"
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, created timestamptz NOT NULL, "
                       "user_id integer NOT NULL)")
        cursor.execute("INSERT INTO authtoken_token VALUES (%s, now(), %s)", [legacy, user.pk])
    migration = importlib.import_module("accounts.migrations.0003_tokens_from_authtoken")
    from django.apps import apps

    with connection.schema_editor() as editor:
        migration.tokens_from_authtoken(apps, editor)
    assert "authtoken_token" not in connection.introspection.table_names()
    row = OperatorToken.objects.get(user=user)
    assert row.prefix == legacy[:8] and legacy not in (row.secret_hash, row.name)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {legacy}")
    assert client.get("/api/v1/nodes/").status_code == 200
