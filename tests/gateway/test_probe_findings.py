"""What the security probe found on /v1, closed: a body that is not declared
JSON is refused (415) before it is read, and a key restricted to some models
gets one answer for a model it may not use and for one that does not exist."""

from __future__ import annotations

import httpx
import pytest

from .conftest import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def test_bodies_not_declared_json_are_415(gateway_web, make_replica, fake_engine, api_key):
    engine = fake_engine("m")
    make_replica("m", engine.port)
    key = api_key()
    web = gateway_web()
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=web.url, timeout=10) as client:
        wait_until(lambda: client.post("/v1/chat/completions", content=BODY,
                                       headers={**auth, "Content-Type": "application/json"}).status_code == 200,
                   timeout=5, message="the model served")
        served = len(engine.requests)
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                             None):
            headers = dict(auth)
            if content_type:
                headers["Content-Type"] = content_type
            answer = client.post("/v1/chat/completions", content=BODY, headers=headers)
            assert answer.status_code == 415, (content_type, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "unsupported_media_type" and error["type"] == "invalid_request_error"
            assert "application/json" in error["message"]
        # Refused before the key is looked at, too: no key, still 415.
        assert client.post("/v1/completions", content=b'{"model":"m","prompt":"x"}',
                           headers={"Content-Type": "text/plain"}).status_code == 415
        # A charset parameter is fine.
        assert client.post("/v1/chat/completions", content=BODY,
                           headers={**auth, "Content-Type": "application/json; charset=utf-8"}).status_code == 200
    assert len(engine.requests) == served + 1


def test_a_restricted_key_cannot_tell_other_models_from_none(gateway_web, make_replica, fake_engine, api_key):
    engine = fake_engine("m")
    make_replica("m", engine.port)
    make_replica("secret-model", engine.port)
    key = api_key(models=["m"])
    web = gateway_web()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=web.url, headers=headers, timeout=10) as client:
        wait_until(lambda: client.post("/v1/chat/completions", json={"model": "m", "messages": []}).status_code
                   in (200, 400), timeout=5, message="the gateway's table loaded")

        def ask(model: str) -> tuple[int, dict]:
            answer = client.post("/v1/chat/completions",
                                 json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
            return answer.status_code, answer.json()

        other = ask("secret-model")
        nowhere = ask("no-such-model")
        assert other[0] == nowhere[0] == 404
        assert other[1]["error"]["code"] == nowhere[1]["error"]["code"] == "model_not_found"
        assert other[1]["error"]["message"].replace("secret-model", "X") == \
            nowhere[1]["error"]["message"].replace("no-such-model", "X")
        assert "secret-model" not in nowhere[1]["error"]["message"]
        assert client.get("/v1/models/secret-model").status_code == client.get("/v1/models/nope").status_code == 404
