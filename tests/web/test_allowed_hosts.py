"""DNS rebinding: with DJANGO_ALLOWED_HOSTS unset, the web process answers
only to Host headers naming loopback, the address it listens on and
LLMGW_PUBLIC_URL's host. /metrics answered 'Host: rebind.evil.example'
(its lean handler runs no middleware); now every path refuses it."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.django_db(transaction=True)

PATHS = ("/metrics", "/v1/models", "/api/v1/nodes/", "/login/")


def test_foreign_host_header_is_refused_everywhere(web_factory):
    web = web_factory()
    with httpx.Client(base_url=web.url, timeout=10) as client:
        for path in PATHS:
            evil = client.get(path, headers={"Host": "rebind.evil.example"})
            assert evil.status_code == 400, (path, evil.status_code, evil.text[:200])
            assert "rebind" not in evil.text or path == "/metrics" and "llmgw_" not in evil.text
        # The names it does answer to.
        for host in (f"127.0.0.1:{web.port}", f"localhost:{web.port}"):
            assert client.get("/metrics", headers={"Host": host}).status_code == 200, host
            assert client.get("/login/", headers={"Host": host}).status_code == 200, host


def test_public_url_host_and_explicit_setting_are_answered(web_factory):
    web = web_factory(LLMGW_PUBLIC_URL="http://llmgw.example.org")
    assert httpx.get(f"{web.url}/login/", headers={"Host": "llmgw.example.org"}, timeout=10).status_code == 200
    other = web_factory(DJANGO_ALLOWED_HOSTS="ops.example.org")
    assert httpx.get(f"{other.url}/login/", headers={"Host": "ops.example.org"}, timeout=10).status_code == 200
    assert httpx.get(f"{other.url}/login/", timeout=10).status_code == 400
