"""Per-key limits (gateway/limits.py) through real gateway processes and Redis:
RPM exact across two processes, TPM and budgets settled to the engines'
usage (streams included), concurrency, expiry; OpenAI's 429 shapes and
x-ratelimit-* headers; the hourly usage equal to what the engines reported."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time

import httpx
import pytest

from .conftest import wait_until

pytestmark = pytest.mark.usefixtures("clean_limits")


@pytest.fixture
def clean_limits():
    """Redis counters of earlier runs (key ids are reused by a fresh test database)."""
    from gateway.inflight import store

    client = store().client
    names = list(client.scan_iter("llmgw:limit:*"))
    if names:
        client.delete(*names)
    yield


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], **extra}


def _estimate(body: dict) -> int:
    """What the gateway reserves for this body, sent as json.dumps(body) (a streamed one is re-encoded
    with stream_options added)."""
    from gateway.bodycheck import ask_for_usage, encode
    from gateway.limits import estimate_tokens

    raw = json.dumps(body).encode()
    if body.get("stream"):
        body = dict(body)
        ask_for_usage(body)
        raw = encode(body)
    return estimate_tokens(len(raw), body.get("max_tokens"), 256)


def _not_at_minute_end(margin: float = 20.0) -> None:
    """Fixed one-minute windows: start a burst where it cannot straddle two."""
    left = 60 - time.time() % 60
    if left < margin:
        time.sleep(left + 0.2)


async def _burst(urls: list[str], key: str, body: dict, count: int, concurrency: int) -> list[httpx.Response]:
    semaphore = asyncio.Semaphore(concurrency)
    clients = [httpx.AsyncClient(base_url=u, headers={"Authorization": f"Bearer {key}"}, timeout=30) for u in urls]

    async def one(i: int) -> httpx.Response:
        async with semaphore:
            return await clients[i % len(clients)].post("/v1/chat/completions", json=body)

    try:
        return await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        for client in clients:
            await client.aclose()


def test_rpm_is_exact_across_two_gateway_processes(gateway_web, make_replica, fake_engine, api_key):
    from gateway.services import key_update

    engine = fake_engine("m")
    make_replica("m", engine.port)
    key = api_key("team-a")
    key_update(name="team-a", rpm=25)
    webs = [gateway_web(), gateway_web()]
    _not_at_minute_end()
    answers = asyncio.run(_burst([w.url for w in webs], key, _chat("m"), 80, 32))
    codes = [a.status_code for a in answers]
    assert codes.count(200) == 25 and codes.count(429) == 55, codes
    refused = next(a for a in answers if a.status_code == 429)
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "requests per minute" in error["message"] and "limit 25" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-limit-requests"] == "25"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    ok = next(a for a in answers if a.status_code == 200)
    assert ok.headers["x-ratelimit-limit-requests"] == "25"
    assert int(ok.headers["x-ratelimit-remaining-requests"]) in range(0, 25)
    assert ok.headers["x-ratelimit-reset-requests"].endswith("s")
    assert len(engine.requests) == 25


def test_tpm_reserves_then_settles_to_the_engines_usage_streams_included(gateway_web, make_replica, fake_engine,
                                                                        api_key):
    from gateway.services import key_update

    engine = fake_engine("m", events=5)  # reports 7 + 5 = 12 tokens per answer
    make_replica("m", engine.port)
    key = api_key("team-t")
    # Each request reserves ~ body/4 + max_tokens (= 30 + 5 here); 12 are kept when it settles.
    key_update(name="team-t", tpm=120)
    web = gateway_web()
    _not_at_minute_end(30)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    expected, used = 0, 0
    for i in range(12):
        if used + _estimate(_chat("m", max_tokens=5, stream=i % 2 == 1)) > 120:
            break
        expected, used = expected + 1, used + 12
    assert 3 <= expected < 12
    with httpx.Client(base_url=web.url, headers=headers, timeout=10) as client:
        admitted = 0
        for i in range(12):
            stream = i % 2 == 1
            body = _chat("m", max_tokens=5, stream=stream)
            with client.stream("POST", "/v1/chat/completions", content=json.dumps(body)) as answer:
                text = answer.read().decode()
                if answer.status_code == 429:
                    refused = answer
                    break
                assert answer.status_code == 200
                if stream:
                    # The gateway asked the engine for usage and dropped it: this client did not ask.
                    assert '"usage"' not in text.replace('"usage": null', "")
                    assert engine.requests[-1]["stream_options"] == {"include_usage": True}
                admitted += 1
        # 120 tokens a minute at 12 settled tokens each, until a reservation no longer fits.
        assert admitted == expected, (admitted, expected)
        error = json.loads(text)["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "tokens"
        assert refused.headers["x-ratelimit-limit-tokens"] == "120"
        assert int(refused.headers["x-ratelimit-remaining-tokens"]) == 120 - expected * 12


def test_concurrency_limit_and_its_release(gateway_web, make_replica, fake_engine, api_key):
    from gateway.services import key_update

    engine = fake_engine("m")
    engine.mode = "hold"
    make_replica("m", engine.port)
    key = api_key("team-c")
    key_update(name="team-c", max_concurrent=2)
    web = gateway_web()
    headers = {"Authorization": f"Bearer {key}"}

    async def scenario():
        async with httpx.AsyncClient(base_url=web.url, headers=headers, timeout=20) as client:
            held = [asyncio.create_task(client.post("/v1/chat/completions", json=_chat("m", stream=True)))
                    for _ in range(2)]
            for _ in range(100):
                if len(engine.requests) == 2:
                    break
                await asyncio.sleep(0.05)
            third = await client.post("/v1/chat/completions", json=_chat("m"))
            engine.release.set()
            done = await asyncio.gather(*held)
            fourth = await client.post("/v1/chat/completions", json=_chat("m"))
            return third, done, fourth

    third, done, fourth = asyncio.run(scenario())
    assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limit_exceeded"
    assert "concurrent requests" in third.json()["error"]["message"] and third.headers["retry-after"] == "1"
    assert [d.status_code for d in done] == [200, 200]
    assert fourth.status_code == 200  # the slots came back when the streams ended


def test_daily_budget_then_quota_error_and_raising_it(gateway_web, make_replica, fake_engine, api_key):
    from gateway.services import key_update

    engine = fake_engine("m", events=5)
    make_replica("m", engine.port)
    key = api_key("team-b")
    key_update(name="team-b", daily_tokens=50)
    web = gateway_web()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    body = json.dumps(_chat("m", max_tokens=5))
    estimate = _estimate(_chat("m", max_tokens=5))
    fits = (50 - estimate) // 12 + 1  # 12 tokens kept by each; the next reservation must fit in what is left
    with httpx.Client(base_url=web.url, headers=headers, timeout=10) as client:
        codes = [client.post("/v1/chat/completions", content=body).status_code for _ in range(5)]
        assert codes == [200] * fits + [429] * (5 - fits), (codes, estimate)
        refused = client.post("/v1/chat/completions", content=body)
        error = refused.json()["error"]
        assert error["type"] == "insufficient_quota" and error["code"] == "insufficient_quota"
        assert "daily token budget" in error["message"] and f"used {12 * fits}" in error["message"]
        # Until the next UTC midnight.
        assert 0 < int(refused.headers["retry-after"]) <= 86400
        key_update(name="team-b", daily_tokens=None)
        wait_until(lambda: client.post("/v1/chat/completions", json=_chat("m")).status_code == 200, timeout=3,
                   message="the budget lifted")


def test_expired_key_is_refused_until_extended(gateway_web, make_replica, fake_engine, api_key):
    from django.utils import timezone

    from gateway.services import key_update

    engine = fake_engine("m")
    make_replica("m", engine.port)
    key = api_key("team-e")
    key_update(name="team-e", expires_at=timezone.now() - dt.timedelta(seconds=1))
    web = gateway_web()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=web.url, headers=headers, timeout=10) as client:
        wait_until(lambda: client.post("/v1/chat/completions", json=_chat("m")).status_code == 401, timeout=3,
                   message="the expired key refused")
        answer = client.post("/v1/chat/completions", json=_chat("m"))
        assert answer.json()["error"]["code"] == "key_expired" and "expired at" in answer.json()["error"]["message"]
        assert client.get("/v1/models").status_code == 401
        key_update(name="team-e", expires_at=timezone.now() + dt.timedelta(days=1))
        wait_until(lambda: client.post("/v1/chat/completions", json=_chat("m")).status_code == 200, timeout=3,
                   message="the extended key accepted")
    assert len(engine.requests) >= 1


def test_hourly_usage_equals_what_the_engines_reported(gateway_web, make_replica, sim_engine, api_key):
    """Non-streamed, streamed with usage asked for, and streamed without (the gateway asks the engine
    and strips it): the stored totals are the sum of the engines' own usage objects, exactly."""
    from gateway.models import KeyUsage

    port = sim_engine("sim-m")
    make_replica("sim-m", port)
    key = api_key("team-u")
    webs = [gateway_web(), gateway_web()]
    reported = [0, 0, 0]  # requests, prompt, completion
    sizes = [(f"word {i} " * (i + 1), 3 + i % 7) for i in range(12)]
    for i, (content, max_tokens) in enumerate(sizes):
        body = {"model": "sim-m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        client = httpx.Client(base_url=webs[i % 2].url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        with client:
            plain = client.post("/v1/chat/completions", json=body).json()["usage"]
            streamed = client.post("/v1/chat/completions",
                                   json={**body, "stream": True, "stream_options": {"include_usage": True}}).text
            events = [json.loads(line[6:]) for line in streamed.splitlines()
                      if line.startswith("data: {")]
            stream_usage = [e["usage"] for e in events if e.get("usage")]
            assert len(stream_usage) == 1
            stripped = client.post("/v1/chat/completions", json={**body, "stream": True}).text
            assert '"usage"' not in stripped.replace('"usage": null', "").replace('"usage":null', "")
        for usage in (plain, stream_usage[0], plain):  # the stripped stream's usage is the plain one's (same body)
            reported[0] += 1
            reported[1] += usage["prompt_tokens"]
            reported[2] += usage["completion_tokens"]

    def stored():
        rows = KeyUsage.objects.filter(key__name="team-u", model="sim-m")
        return [sum(getattr(r, f) for r in rows) for f in ("requests", "prompt_tokens", "completion_tokens")]

    wait_until(lambda: stored() == reported, timeout=10, message=f"stored usage {stored()} == reported {reported}")
    assert reported[2] > 36


def test_limits_refuse_bad_settings_by_name(transactional_db):
    from django.core.exceptions import ValidationError

    from gateway.services import key_create, key_update

    key_create(name="k1")
    for bad, word in (({"rpm": 0}, "rpm"), ({"tpm": -5}, "tpm"), ({"priority": "urgent"}, "priority"),
                      ({"expires_at": dt.datetime(2030, 1, 1)}, "expires_at"), ({"burst": 3}, "burst")):
        with pytest.raises(ValidationError, match=word):
            key_update(name="k1", **bad)


def test_rest_and_ctl_set_limits(gateway_web, admin_token):
    import subprocess
    import sys

    from tests.conftest import REPO, server_env

    web = gateway_web()
    env = server_env(LLMGW_URL=web.url, LLMGW_TOKEN=admin_token)

    def ctl(*args):
        return subprocess.run([sys.executable, "-m", "cli", "ctl", "keys", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)

    created = ctl("create", "team-x", "--rpm", "60", "--daily-tokens", "100000", "--priority", "batch")
    assert created.returncode == 0, created.stderr
    assert "rpm=60" in created.stdout and "priority batch" in created.stdout
    updated = ctl("update", "team-x", "--rpm", "none", "--tpm", "5000", "--expires", "2030-01-01T00:00:00Z")
    assert updated.returncode == 0, updated.stderr
    assert "tpm=5000" in updated.stdout and "rpm" not in updated.stdout.split(":", 1)[1].replace("tpm", "")
    bad = ctl("update", "team-x", "--tpm", "lots")
    assert bad.returncode == 1 and "--tpm" in bad.stderr
    headers = {"Authorization": f"Token {admin_token}"}
    with httpx.Client(base_url=web.url, headers=headers, timeout=10) as client:
        unknown = client.patch("/api/v1/keys/team-x/", json={"rpm": 5, "rpn": 3})
        assert unknown.status_code == 400 and "rpn" in unknown.text
        assert client.get("/api/v1/keys/team-x/").json()["rpm"] is None  # the refused body changed nothing
        assert client.patch("/api/v1/keys/team-x/", json={"max_concurrent": 0}).status_code == 400
        row = client.patch("/api/v1/keys/team-x/", json={"max_concurrent": 4}).json()
        assert (row["max_concurrent"], row["tpm"], row["priority"]) == (4, 5000, "batch")
        assert row["expires_at"].startswith("2030-01-01")
        assert client.patch("/api/v1/keys/nobody/", json={"rpm": 1}).status_code == 404
    usage = ctl("usage")
    assert usage.returncode == 0, usage.stderr
