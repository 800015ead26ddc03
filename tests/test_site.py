"""Site-wide behaviour of the web process: how operators authenticate, and
the API documentation page working without internet."""

from __future__ import annotations

import re

import httpx


def test_operator_token_as_token_or_bearer(web_factory, admin_token):
    web = web_factory()
    for scheme in ("Token", "Bearer", "bearer"):
        r = httpx.get(f"{web.url}/api/v1/nodes/", headers={"Authorization": f"{scheme} {admin_token}"})
        assert r.status_code == 200, (scheme, r.status_code, r.text)
    for header in (f"Basic {admin_token}", f"Bearer {admin_token} extra", "Bearer", f"Bearer x{admin_token}"):
        r = httpx.get(f"{web.url}/api/v1/nodes/", headers={"Authorization": header})
        assert r.status_code in (401, 403), (header, r.status_code)
        assert r.headers["content-type"].startswith("application/json")
    r = httpx.get(f"{web.url}/api/v1/nodes/", headers={"Authorization": f"Bearer {admin_token} extra"})
    assert "Bearer <token>" in r.json()["detail"]


def test_api_docs_load_nothing_from_outside(web_factory, admin_token):
    web = web_factory()
    with httpx.Client(base_url=web.url, headers={"Authorization": f"Bearer {admin_token}"}) as client:
        page = client.get("/api/docs/")
        assert page.status_code == 200
        # Every script, style and icon the page names is on this server.
        assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert any(a.endswith("swagger-ui-bundle.js") for a in assets), assets
        for asset in assets:
            assert not re.match(r"(https?:)?//", asset), f"/api/docs/ loads {asset} from outside"
            r = client.get(asset)
            assert r.status_code == 200 and r.content, (asset, r.status_code)
        # The page's own script, which starts Swagger UI and names the schema.
        schema = client.get("/api/schema/")
        assert schema.status_code == 200

