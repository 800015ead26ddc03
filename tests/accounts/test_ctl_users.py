"""``llmgw ctl users``: add with a role, list, set-role, through the REST API
of a real web process; only a user allowed to add users may."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import authenticate, get_user_model

from accounts.selectors import user_role
from accounts.services import token_create, user_create
from tests.conftest import server_env
from tests.test_ctl_rest import run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ctl_env(web_factory, admin_token, tmp_path):
    web = web_factory()
    return server_env(LLMGW_URL=web.url, LLMGW_TOKEN=admin_token, LLMGW_DATA_DIR=str(tmp_path / "nowhere"))


def test_users_add_list_set_role(ctl_env, tmp_path):
    password_file = tmp_path / "pw"
    password_file.write_text("a-long-enough-password\n")
    added = run("users", "add", "alice", "--role", "operator", "--password-file", str(password_file), env=ctl_env)
    assert "created user alice with role operator" in added.stdout
    assert "a-long-enough-password" not in added.stdout
    alice = get_user_model().objects.get(username="alice")
    assert user_role(alice) == "operator" and not alice.is_staff
    assert authenticate(username="alice", password="a-long-enough-password") == alice

    generated = run("users", "add", "bob", "--role", "viewer", env=ctl_env).stdout
    password = generated.split("password: ")[1].split()[0]
    assert authenticate(username="bob", password=password) is not None

    listed = {u["username"]: u for u in json.loads(run("users", "list", "-o", "json", env=ctl_env).stdout)}
    assert listed["alice"]["role"] == "operator" and listed["bob"]["role"] == "viewer"
    assert all("password" not in u for u in listed.values())
    assert "bob" in run("users", "list", env=ctl_env).stdout

    assert "bob is now admin" in run("users", "set-role", "bob", "admin", env=ctl_env).stdout
    bob = get_user_model().objects.get(username="bob")
    assert user_role(bob) == "admin" and bob.is_staff
    assert "bob is now superuser" in run("users", "set-superuser", "bob", env=ctl_env).stdout
    assert "bob is no longer superuser" in run("users", "set-superuser", "bob", "--revoke", env=ctl_env).stdout
    bob.refresh_from_db()
    assert not bob.is_superuser and bob.is_staff  # still an admin: staff stays

    again = run("users", "add", "alice", "--role", "viewer", env=ctl_env, rc=1)
    assert "400" in again.stderr and "exists already" in again.stderr
    assert "404" in run("users", "set-role", "nobody", "viewer", env=ctl_env, rc=1).stderr
    short = tmp_path / "short"
    short.write_text("x")
    assert "password" in run("users", "add", "carol", "--role", "viewer", "--password-file", str(short),
                             env=ctl_env, rc=1).stderr
    assert not get_user_model().objects.filter(username="carol").exists()


def test_an_operator_cannot_add_users(ctl_env):
    operator, _ = user_create(actor="tests", username="op", role="operator", password="op-password-123")
    env = dict(ctl_env, LLMGW_TOKEN=token_create(user=operator).token)
    refused = run("users", "add", "mallory", "--role", "admin", env=env, rc=1)
    assert "403" in refused.stderr and "auth.add_user" in refused.stderr
    assert "403" in run("users", "set-role", "op", "admin", env=env, rc=1).stderr
    assert "403" in run("users", "set-superuser", "op", env=env, rc=1).stderr
    assert not get_user_model().objects.filter(username="mallory").exists()
    assert user_role(get_user_model().objects.get(username="op")) == "operator"
