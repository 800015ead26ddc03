"""/v1 and /metrics bypass Django's middleware; the rest of the site does not."""

from __future__ import annotations

import httpx


def test_v1_skips_the_middleware_and_the_dashboard_keeps_it(gateway_web, make_replica, fake_engine):
    engine = fake_engine("m")
    make_replica("m", engine.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    with httpx.Client(base_url=web.url, timeout=10, headers={"Accept-Encoding": "gzip"}) as client:
        v1 = client.get("/v1/models")
        metrics = client.get("/metrics")
        admin = client.get("/admin/login/")
    assert admin.headers["x-frame-options"] == "DENY"  # XFrameOptionsMiddleware ran
    for response in (v1, metrics):
        assert response.status_code == 200
        assert "x-frame-options" not in response.headers
        assert "content-encoding" not in response.headers
        assert "set-cookie" not in response.headers
        assert int(response.headers["content-length"]) == len(response.content)
