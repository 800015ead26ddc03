"""API keys: created and revoked with 'llmgw ctl keys', the REST API and the
services; stored hashed; restricted to models; counted; refused when bad."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx

from tests.conftest import REPO

from .conftest import wait_until


def _chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def _ctl(web, token: str, *args: str) -> subprocess.CompletedProcess:
    from tests.conftest import server_env

    env = server_env(LLMGW_URL=web.url, LLMGW_TOKEN=token)
    return subprocess.run([sys.executable, "-m", "cli", "ctl", "keys", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_ctl_keys_create_list_revoke(gateway_web, make_replica, fake_engine, admin_token):
    from gateway.models import ApiKey

    engine = fake_engine("m")
    make_replica("m", engine.port)
    make_replica("other", engine.port)
    web = gateway_web()
    created = _ctl(web, admin_token, "create", "alice", "--models", "m")
    assert created.returncode == 0, created.stderr
    key = re.search(r"sk-llmgw-\w+", created.stdout).group(0)
    row = ApiKey.objects.get(name="alice")
    assert key not in (row.secret_hash, row.prefix) and key.startswith(row.prefix)
    assert row.allowed_models == ["m"]

    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=web.url, headers=headers, timeout=10) as client:
        # Keys created after the gateway started are usable within a second.
        wait_until(lambda: client.post("/v1/chat/completions", json=_chat("m")).status_code == 200, timeout=1.5,
                   message="the new key accepted")
        refused = client.post("/v1/chat/completions", json=_chat("other"))
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m"]

        listing = _ctl(web, admin_token, "list")
        assert listing.returncode == 0 and "alice" in listing.stdout and key not in listing.stdout
        assert _ctl(web, admin_token, "create", "alice").returncode == 1  # the name is taken
        quiet = _ctl(web, admin_token, "create", "carol", "-q")
        assert quiet.returncode == 0 and re.fullmatch(r"sk-llmgw-\w{40}\n", quiet.stdout)
        bad = _ctl(web, admin_token, "create", "bob", "--models", "no-such-model")
        assert bad.returncode == 1 and "no-such-model" in bad.stderr

        revoked = _ctl(web, admin_token, "revoke", "alice")
        assert revoked.returncode == 0, revoked.stderr
        wait_until(lambda: client.post("/v1/chat/completions", json=_chat("m")).status_code == 401, timeout=1.5,
                   message="the revoked key refused")
        error = client.post("/v1/chat/completions", json=_chat("m")).json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    # At least three requests with the key (completions, a refusal, the model
    # list); the 401s are nobody's. Each completion: 7 prompt and 5 completion tokens.
    row = wait_until(lambda: ApiKey.objects.filter(name="alice", requests__gte=3).first(), timeout=5,
                     message="usage flushed")
    completions = row.requests - 2
    assert (row.prompt_tokens, row.completion_tokens) == (7 * completions, 5 * completions)


def test_rest_api_shows_the_key_once(web_factory, admin_token):
    web = web_factory()
    with httpx.Client(base_url=web.url, headers={"Authorization": f"Token {admin_token}"}, timeout=10) as client:
        created = client.post("/api/v1/keys/", json={"name": "ci"})
        assert created.status_code == 201, created.text
        assert created.json()["key"].startswith("sk-llmgw-")
        shown = client.get("/api/v1/keys/ci/").json()
        assert "key" not in shown and "secret_hash" not in shown and shown["models"] == []
        assert client.post("/api/v1/keys/", json={"name": "bad name!"}).status_code == 400
        assert client.post("/api/v1/keys/nobody/revoke/").status_code == 404
        assert client.post("/api/v1/keys/ci/revoke/").json()["revoked"] is True
        assert httpx.get(f"{web.url}/api/v1/keys/", timeout=10).status_code in (401, 403)


def test_requests_without_a_valid_key_are_401(gateway_web, make_replica, fake_engine, api_key):
    engine = fake_engine("m")
    make_replica("m", engine.port)
    api_key()
    web = gateway_web()
    for headers in ({}, {"Authorization": "Bearer sk-llmgw-wrong"}, {"Authorization": "Basic dXNlcjpwYXNz"},
                    {"Authorization": "Bearer"}):
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            response = httpx.request(method, f"{web.url}{path}", json=_chat("m"), headers=headers, timeout=10)
            assert response.status_code == 401, (headers, path)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert not engine.requests


def test_open_gateway_needs_no_key_and_says_so(gateway_web, make_replica, fake_engine):
    engine = fake_engine("m")
    make_replica("m", engine.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    assert httpx.post(f"{web.url}/v1/chat/completions", json=_chat("m"), timeout=10).status_code == 200
    assert httpx.post(f"{web.url}/v1/chat/completions", json=_chat("m"), timeout=10,
                      headers={"Authorization": "Bearer anything"}).status_code == 200
    assert "WITHOUT AN API KEY" in web.log()


def test_usage_is_written_when_the_process_stops(make_replica, fake_engine, api_key, tmp_path):
    """Counts are added every two seconds, and once more on the way out when
    the server sends lifespan events (as 'llmgw up' runs uvicorn)."""
    from gateway.models import ApiKey
    from cli.commands import web_argv
    from gateway.selectors import gateway_processes
    from tests.conftest import Server, free_port, server_env

    engine = fake_engine("m")
    make_replica("m", engine.port)
    key = api_key("lifespan")
    port = free_port()
    web = Server("web", web_argv(host="127.0.0.1", port=port),
                 server_env(LLMGW_GATEWAY_SYNC_INTERVAL="0.1"), "127.0.0.1", port, tmp_path / "web.log")
    try:
        web.start()
        for _ in range(3):
            response = httpx.post(f"{web.url}/v1/chat/completions", json=_chat("m"), timeout=10,
                                  headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200
        wait_until(lambda: gateway_processes(), timeout=2, message="the process's record")
        web.stop()  # at once: well inside the two seconds between flushes
        assert ApiKey.objects.get(name="lifespan").requests == 3, web.log()
        assert gateway_processes() == []  # it took its record with it
    finally:
        web.stop()


def test_a_key_works_on_its_first_request_after_keys_create(gateway_web, make_replica, fake_engine, admin_token):
    """The gateway's table reloads only every 30 s here: the new key is looked up once in the database."""
    engine = fake_engine("m")
    make_replica("m", engine.port)
    web = gateway_web(LLMGW_GATEWAY_SYNC_INTERVAL="30")
    with httpx.Client(base_url=web.url, timeout=10) as client:
        assert client.get("/v1/models").status_code == 401  # the gateway is up, its table loaded
        created = _ctl(web, admin_token, "create", "fresh", "-q")
        assert created.returncode == 0, created.stderr
        headers = {"Authorization": f"Bearer {created.stdout.strip()}"}
        assert client.post("/v1/chat/completions", json=_chat("m"), headers=headers).status_code == 200
        wrong = {"Authorization": "Bearer sk-llmgw-" + "x" * 40}
        assert client.post("/v1/chat/completions", json=_chat("m"), headers=wrong).status_code == 401


def test_unknown_keys_are_looked_up_once_and_a_flood_is_bounded(transactional_db, monkeypatch):
    import asyncio

    from gateway import runtime, selectors
    from gateway.services import key_create

    calls = []
    real = selectors.key_by_secret_hash
    monkeypatch.setattr(selectors, "key_by_secret_hash", lambda **kw: calls.append(kw) or real(**kw))
    gw = runtime.Gateway()

    async def scenario():
        wrong = "Bearer sk-llmgw-" + "x" * 40
        assert await asyncio.gather(*[gw.authenticate_or_look_up(wrong) for _ in range(50)]) == [None] * 50
        assert await gw.authenticate_or_look_up(wrong) is None
        assert len(calls) == 1  # one lookup, shared, then remembered
        started = time.monotonic()
        for i in range(300):  # all different: the lookups are rate-limited
            assert await gw.authenticate_or_look_up(f"Bearer sk-llmgw-{i:040d}") is None
        # A bucket of one second's lookups, refilled at that rate while the flood lasts (each
        # lookup that goes through waits for the database: on a busy machine that takes a while).
        allowed = runtime.KEY_LOOKUPS_PER_SECOND * (1 + time.monotonic() - started)
        assert len(calls) <= 1 + allowed + 1, (len(calls), allowed)
        assert await gw.authenticate_or_look_up("Bearer not-a-key") is None  # not even looked up
        flooded = len(calls)
        await asyncio.sleep(1.0)  # the limit refills
        made = await asyncio.get_running_loop().run_in_executor(gw._db, lambda: key_create(name="late").key)
        key = await gw.authenticate_or_look_up(f"Bearer {made}")
        assert key is not None and key.name == "late" and len(calls) == flooded + 1
        assert await gw.authenticate_or_look_up(f"Bearer {made}") == key and len(calls) == flooded + 1

    try:
        asyncio.run(scenario())
    finally:
        from django.db import connections

        gw._db.submit(lambda: connections.close_all()).result()  # the gateway thread's own connection
        gw._db.shutdown()
    assert 0 < len(gw._unknown_keys) <= runtime.UNKNOWN_KEYS_MAX
