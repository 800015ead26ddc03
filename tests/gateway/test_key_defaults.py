"""The deployment's defaults for new keys (LLMGW_KEYS_DEFAULT_*): written on a key when it is created,
through the services, 'llmgw ctl keys create' and the REST API (the gateway page's form:
tests/ui/test_gateway_limits.py); an explicit 'none' and a given value win over them; a default changed
later leaves existing keys as they are; bad values refused at start, by name."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys

import httpx
import pytest
from django.utils import timezone

from tests.conftest import REPO, kill_group, server_env

_DEFAULTS = {"LLMGW_KEYS_DEFAULT_RPM": 60, "LLMGW_KEYS_DEFAULT_TPM": 0, "LLMGW_KEYS_DEFAULT_MAX_CONCURRENT": 4,
             "LLMGW_KEYS_DEFAULT_DAILY_TOKENS": 100_000, "LLMGW_KEYS_DEFAULT_MONTHLY_TOKENS": 0,
             "LLMGW_KEYS_DEFAULT_EXPIRES_DAYS": 30, "LLMGW_KEYS_DEFAULT_PRIORITY": "batch"}


@pytest.fixture
def key_defaults(settings):
    for name, value in _DEFAULTS.items():
        setattr(settings, name, value)
    return settings


def _limits(row) -> tuple:
    return row.rpm, row.tpm, row.max_concurrent, row.daily_tokens, row.monthly_tokens, row.priority


def test_services_apply_the_defaults_a_caller_did_not_override(transactional_db, key_defaults):
    from gateway.services import key_create

    before = timezone.now()
    row = key_create(name="plain").row
    row.refresh_from_db()
    assert _limits(row) == (60, None, 4, 100_000, None, "batch")
    assert before + dt.timedelta(days=30) <= row.expires_at <= timezone.now() + dt.timedelta(days=30)

    row = key_create(name="free", rpm=None, max_concurrent=None, daily_tokens=None, expires_at=None,
                     priority="interactive").row
    row.refresh_from_db()
    assert _limits(row) == (None, None, None, None, None, "interactive") and row.expires_at is None

    row = key_create(name="given", rpm=5, tpm=1000).row
    row.refresh_from_db()
    assert _limits(row) == (5, 1000, 4, 100_000, None, "batch")


def test_a_default_changed_later_leaves_existing_keys_alone(transactional_db, key_defaults):
    from gateway.models import ApiKey
    from gateway.services import key_create

    old = key_create(name="old").row
    key_defaults.LLMGW_KEYS_DEFAULT_RPM, key_defaults.LLMGW_KEYS_DEFAULT_PRIORITY = 0, "interactive"
    key_defaults.LLMGW_KEYS_DEFAULT_EXPIRES_DAYS = 0
    new = key_create(name="new").row
    old, new = ApiKey.objects.get(pk=old.pk), ApiKey.objects.get(pk=new.pk)
    assert (old.rpm, old.priority) == (60, "batch") and old.expires_at is not None
    assert (new.rpm, new.priority, new.expires_at) == (None, "interactive", None)


def test_without_defaults_a_key_has_no_limits(transactional_db):
    from gateway.services import key_create

    row = key_create(name="bare").row
    row.refresh_from_db()
    assert _limits(row) == (None, None, None, None, None, "standard") and row.expires_at is None


def test_ctl_and_rest_create_with_the_web_process_defaults(web_factory, admin_token):
    web = web_factory(**{name: str(value) for name, value in _DEFAULTS.items()})
    env = server_env(LLMGW_URL=web.url, LLMGW_TOKEN=admin_token)

    def ctl(*args):
        return subprocess.run([sys.executable, "-m", "cli", "ctl", "keys", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)

    plain = ctl("create", "plain")
    assert plain.returncode == 0, plain.stderr
    assert "rpm=60, max_concurrent=4, daily_tokens=100000, expires " in plain.stdout, plain.stdout
    assert "priority batch" in plain.stdout
    free = ctl("create", "free", "--rpm", "none", "--max-concurrent", "none", "--daily-tokens", "none",
               "--expires", "none", "--priority", "standard", "--tpm", "500")
    assert free.returncode == 0, free.stderr
    assert "limits: tpm=500, priority standard" in free.stdout, free.stdout
    listing = ctl("list")
    assert listing.returncode == 0, listing.stderr
    line = next(line for line in listing.stdout.splitlines() if line.startswith("plain"))
    assert "rpm=60" in line and "batch" in line

    headers = {"Authorization": f"Token {admin_token}"}
    with httpx.Client(base_url=web.url, headers=headers, timeout=10) as client:
        defaulted = client.post("/api/v1/keys/", json={"name": "api-plain"})
        assert defaulted.status_code == 201, defaulted.text
        body = defaulted.json()
        assert (body["rpm"], body["tpm"], body["max_concurrent"], body["priority"]) == (60, None, 4, "batch")
        assert body["expires_at"] is not None
        explicit = client.post("/api/v1/keys/", json={"name": "api-free", "rpm": None, "expires_at": None,
                                                      "max_concurrent": 2, "priority": "interactive"}).json()
        assert (explicit["rpm"], explicit["max_concurrent"], explicit["daily_tokens"], explicit["priority"],
                explicit["expires_at"]) == (None, 2, 100_000, "interactive", None)
        assert client.post("/api/v1/keys/", json={"name": "api-zero", "rpm": 0}).status_code == 400
        listed = {k["name"]: k for k in client.get("/api/v1/keys/").json()}
        assert listed["plain"]["rpm"] == 60 and listed["free"]["rpm"] is None and listed["free"]["tpm"] == 500


@pytest.mark.parametrize("env, says", [
    ({"LLMGW_KEYS_DEFAULT_RPM": "-5"}, "LLMGW_KEYS_DEFAULT_RPM='-5' must be a whole number from 0"),
    ({"LLMGW_KEYS_DEFAULT_DAILY_TOKENS": "lots"}, "LLMGW_KEYS_DEFAULT_DAILY_TOKENS='lots' must be a whole number"),
    ({"LLMGW_KEYS_DEFAULT_EXPIRES_DAYS": "99999999999"}, "(0 or unset: never expires)"),
    ({"LLMGW_KEYS_DEFAULT_PRIORITY": "urgent"},
     "LLMGW_KEYS_DEFAULT_PRIORITY='urgent' is not a priority class: use one of interactive, standard, batch"),
])
def test_bad_defaults_are_refused_at_start_by_name(tmp_path, env, says):
    # In a process group of its own: were the check ever to let it start, what it started is stopped too.
    up = subprocess.Popen([sys.executable, "-m", "cli", "up", "--data-dir", str(tmp_path)], cwd=REPO,
                          env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
    try:
        _, stderr = up.communicate(timeout=60)
    finally:
        kill_group(up.pid)
        up.wait()
    assert up.returncode != 0
    assert stderr.startswith("llmgw: defaults of new API keys that cannot work"), stderr[-500:]
    assert says in stderr
    assert "Traceback" not in stderr
