"""Accounts hold their ground: Django's four password validators on every
path that sets a password, failed logins throttled per user and per address
(and logged), and roles and superuser grants changed only through
accounts.services, which records who did it; the Django admin cannot."""

from __future__ import annotations

import logging

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from accounts import roles, services
from accounts.selectors import user_role
from core.models import Event

pytestmark = pytest.mark.django_db

LOGIN = "/login/"


@pytest.fixture(autouse=True)
def _fast(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _api(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {services.token_create(user=user).token}")
    return client


@pytest.fixture
def root():
    return get_user_model().objects.create_superuser("root", "", "root-password-for-tests")


@pytest.fixture
def admin_user():
    return services.user_create(actor="tests", username="adm", role=roles.ADMIN, password="adm-password-for-tests")[0]


@pytest.mark.parametrize("username,password", [
    ("alice", "password"), ("alice", "12345678"), ("alice", "short"), ("alice1234", "alice1234"),
])
def test_weak_passwords_are_refused_by_the_api(root, username, password):
    answer = _api(root).post("/api/v1/users/", {"username": username, "role": "viewer", "password": password},
                             format="json")
    assert answer.status_code == 400, answer.content
    assert "password" in answer.json()["detail"] or "password" in answer.content.decode()
    assert not get_user_model().objects.filter(username=username).exists()


def test_weak_password_is_refused_by_the_admins_password_form(client, root, admin_user):
    client.force_login(root)
    answer = client.post(f"/admin/auth/user/{admin_user.pk}/password/",
                         {"password1": "password", "password2": "password"})
    assert answer.status_code == 200 and b"This password is too common" in answer.content
    admin_user.refresh_from_db()
    assert admin_user.check_password("adm-password-for-tests")


def _login(client, username, password, address="127.0.0.1"):
    return client.post(LOGIN, {"username": username, "password": password}, REMOTE_ADDR=address)


def test_failed_logins_are_throttled_per_user_and_logged(client, admin_user, settings, caplog):
    settings.LLMGW_LOGIN_FAILURES_PER_USER = 5
    caplog.set_level(logging.WARNING)
    for _ in range(5):
        assert _login(client, "adm", "wrong-guess").status_code == 200  # the form again, with its error
    # The right password no longer lets anyone in for this user, from any address.
    answer = _login(client, "adm", "adm-password-for-tests", address="127.0.0.9")
    assert answer.status_code == 200 and "_auth_user_id" not in client.session
    assert "login failed user='adm' client=127.0.0.1 failures_for_user=5" in caplog.text
    assert "login refused (throttled: 5 failed logins for this user) user='adm' client=127.0.0.9" in caplog.text
    # Another user is not held up.
    services.user_create(actor="tests", username="bob", role=roles.VIEWER, password="bob-password-for-tests")
    assert _login(client, "bob", "bob-password-for-tests").status_code == 302


def test_failed_logins_are_throttled_per_address(client, admin_user, settings):
    settings.LLMGW_LOGIN_FAILURES_PER_ADDRESS = 6
    for i in range(6):
        _login(client, f"nobody{i}", "wrong-guess", address="127.0.0.5")
    assert _login(client, "adm", "adm-password-for-tests", address="127.0.0.5").status_code == 200
    assert _login(client, "adm", "adm-password-for-tests", address="127.0.0.6").status_code == 302


def test_the_django_admin_login_is_throttled_too(client, admin_user, settings):
    settings.LLMGW_LOGIN_FAILURES_PER_USER = 3
    for _ in range(3):
        client.post("/admin/login/", {"username": "adm", "password": "nope-nope"})
    client.post("/admin/login/", {"username": "adm", "password": "adm-password-for-tests"})
    assert "_auth_user_id" not in client.session


def test_an_admin_cannot_make_itself_superuser_in_the_django_admin(client, admin_user):
    client.force_login(admin_user)
    page = client.get(f"/admin/auth/user/{admin_user.pk}/change/")
    assert page.status_code == 200
    answer = client.post(f"/admin/auth/user/{admin_user.pk}/change/", {
        "username": "adm", "is_active": "on", "is_staff": "on", "is_superuser": "on",
        "groups": [g.pk for g in admin_user.groups.all()],
        "last_login_0": "", "last_login_1": "", "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00",
    })
    assert answer.status_code in (200, 302)
    admin_user.refresh_from_db()
    assert not admin_user.is_superuser
    # Nor give the viewer role every permission, nor add users without a role.
    assert client.get("/admin/auth/group/1/change/").status_code in (200, 403)
    assert client.post("/admin/auth/group/1/change/", {"name": "viewer", "permissions": []}).status_code == 403
    assert client.post("/admin/auth/user/add/", {"username": "x", "password1": "pw-Ab12-cdxy",
                                                 "password2": "pw-Ab12-cdxy"}).status_code == 403


def test_superuser_grants_only_by_a_superuser_and_recorded(root, admin_user):
    refused = _api(admin_user).post("/api/v1/users/adm/set-superuser/", {"superuser": True}, format="json")
    assert refused.status_code == 403
    admin_user.refresh_from_db()
    assert not admin_user.is_superuser
    granted = _api(root).post("/api/v1/users/adm/set-superuser/", {"superuser": True}, format="json")
    assert granted.status_code == 200 and granted.json()["is_superuser"] is True
    event = Event.objects.filter(subject="user/adm").latest("id")
    assert event.message == "user adm granted superuser by user root" and event.data["actor"] == "user root"


def test_user_creation_and_role_changes_are_events_naming_who(root):
    api = _api(root)
    assert api.post("/api/v1/users/", {"username": "carol", "role": "viewer"}, format="json").status_code == 201
    assert api.post("/api/v1/users/carol/set-role/", {"role": "admin"}, format="json").status_code == 200
    messages = list(Event.objects.filter(subject="user/carol").order_by("id").values_list("message", flat=True))
    assert messages == ["user carol created by user root as viewer",
                        "user carol's role changed by user root: viewer -> admin"]
    assert user_role(get_user_model().objects.get(username="carol")) == roles.ADMIN
