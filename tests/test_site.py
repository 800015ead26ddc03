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



def _settings_in_a_fresh_process(tmp_path, *, prelude: str = "", **env: str) -> dict:
    """The settings a process started with ``env`` gets (they are read once)."""
    import json
    import os
    import subprocess
    import sys

    code = prelude + (
        "import json, django; from django.conf import settings as s; django.setup(); print(json.dumps({"
        "k: getattr(s, k, None) for k in ('SESSION_COOKIE_SECURE', 'CSRF_COOKIE_SECURE', 'SECURE_HSTS_SECONDS',"
        " 'CSRF_TRUSTED_ORIGINS', 'SECURE_PROXY_SSL_HEADER')}))"
    )
    full = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_PUBLIC")}
    full.update(DJANGO_SETTINGS_MODULE="llmgw_site.settings", LLMGW_DATA_DIR=str(tmp_path / "data"), **env)
    done = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=60)
    return {"returncode": done.returncode, "stderr": done.stderr,
            **(json.loads(done.stdout) if done.returncode == 0 else {})}


def test_behind_tls_cookies_are_secure_and_hsts_is_on(tmp_path):
    plain = _settings_in_a_fresh_process(tmp_path)
    assert plain["returncode"] == 0, plain["stderr"]
    assert not plain["SESSION_COOKIE_SECURE"] and not plain["SECURE_HSTS_SECONDS"]

    tls = _settings_in_a_fresh_process(tmp_path, LLMGW_PUBLIC_URL="https://llmgw.example.org/")
    assert tls["returncode"] == 0, tls["stderr"]
    assert tls["SESSION_COOKIE_SECURE"] and tls["CSRF_COOKIE_SECURE"]
    assert tls["SECURE_HSTS_SECONDS"] >= 31536000
    assert tls["CSRF_TRUSTED_ORIGINS"] == ["https://llmgw.example.org"]
    assert tls["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]

    wrong = _settings_in_a_fresh_process(tmp_path, LLMGW_PUBLIC_URL="llmgw.example.org")
    assert wrong["returncode"] != 0 and "give the full address" in wrong["stderr"]


def test_secret_key_is_created_0600(tmp_path):
    done = _settings_in_a_fresh_process(tmp_path)
    assert done["returncode"] == 0, done["stderr"]
    key = tmp_path / "data" / "secret-key"
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    assert len(key.read_text().strip()) == 64
    # Created with that mode, not chmodded after: with chmod doing nothing it is still 0600.
    key.unlink()
    no_chmod = "import os, pathlib; os.chmod = pathlib.Path.chmod = lambda *a, **k: None\n"
    assert _settings_in_a_fresh_process(tmp_path, prelude=no_chmod)["returncode"] == 0
    assert oct(key.stat().st_mode & 0o777) == "0o600"


def test_deeply_nested_json_is_a_400_not_a_500(web_factory, admin_token):
    web = web_factory()
    body = "[" * 100_000 + "]" * 100_000
    r = httpx.post(f"{web.url}/api/v1/keys/", content=body, timeout=30,
                   headers={"Authorization": f"Bearer {admin_token}", "Content-Type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert "nested too deeply" in r.json()["detail"]


def test_a_nul_byte_in_a_path_or_filter_is_a_400(web_factory, admin_token):
    web = web_factory()
    auth = {"Authorization": f"Bearer {admin_token}"}
    for path in ("/api/v1/nodes/a%00b/", "/api/v1/events/?kind=%00", "/api/v1/nodes/?x=%2500&y=%00"):
        r = httpx.get(f"{web.url}{path}", headers=auth, timeout=10)
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
        assert "NUL" in r.json()["detail"]
    r = httpx.get(f"{web.url}/nodes/a%00b/", headers=auth, timeout=10)
    assert r.status_code == 400 and "NUL" in r.text


def test_every_package_of_the_checkout_is_installed():
    """A non-editable install (production, the prod check) takes only the
    packages pyproject.toml lists: one left out is an app that is missing
    at start."""
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    include = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.parent.name for p in root.glob("*/__init__.py")} - {"tests", "bench", "tools"}
    missing = sorted(p for p in packages if not any(fnmatch(p, pattern) for pattern in include))
    assert not missing, f"pyproject.toml's packages.find include leaves out {missing}"
