"""The TLS reverse proxy sample (deploy/nginx-llmgw.conf): nginx accepts it,
and in front of a real web process it serves the site over TLS with Secure
cookies, keeps /metrics to itself, and streams /v1."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, free_port, wait_for_port

SAMPLE = REPO / "deploy" / "nginx-llmgw.conf"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def _render(tmp_path: Path, pki_dir: Path, *, web_port: int, https_port: int, http_port: int) -> Path:
    """The sample with this machine's paths and ports, inside a main config of its own."""
    site = SAMPLE.read_text()
    for old, new in [
        ("server 127.0.0.1:8000;", f"server 127.0.0.1:{web_port};"),
        ("listen 443 ssl;", f"listen 127.0.0.1:{https_port} ssl;"),
        ("listen [::]:443 ssl;", ""),
        ("listen 80;", f"listen 127.0.0.1:{http_port};"),
        ("listen [::]:80;", ""),
        ("/etc/ssl/llmgw/fullchain.pem", str(pki_dir / "server.pem")),
        ("/etc/ssl/llmgw/privkey.pem", str(pki_dir / "server-key.pem")),
    ]:
        assert old in site, old
        site = site.replace(old, new)
    (tmp_path / "llmgw.conf").write_text(site)
    main = tmp_path / "nginx.conf"
    main.write_text(f"""
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/error.log;
daemon off;
events {{}}
http {{
    access_log off;
    client_body_temp_path {tmp_path}/body;
    proxy_temp_path {tmp_path}/proxy;
    include {tmp_path}/llmgw.conf;
}}
""")
    return main


@pytest.fixture
def nginx():
    if not Path(NGINX).exists():
        pytest.fail("nginx is not installed: scripts/test-deps.sh installs Debian's nginx-light")
    return NGINX


def test_nginx_accepts_the_sample(nginx, pki_dir, tmp_path):
    main = _render(tmp_path, pki_dir, web_port=8000, https_port=free_port(), http_port=free_port())
    checked = subprocess.run([nginx, "-t", "-c", str(main), "-e", str(tmp_path / "error.log")],
                             capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr
    assert "test is successful" in checked.stderr


def test_the_sample_in_front_of_the_web_process(nginx, pki_dir, tmp_path, web_factory):
    https_port, http_port = free_port(), free_port()
    public = f"https://localhost:{https_port}"
    web = web_factory(LLMGW_PUBLIC_URL=public, LLMGW_GATEWAY_OPEN="1")
    main = _render(tmp_path, pki_dir, web_port=web.port, https_port=https_port, http_port=http_port)
    proc = subprocess.Popen([nginx, "-c", str(main), "-e", str(tmp_path / "error.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port("127.0.0.1", https_port, proc=proc)
        plain = httpx.get(f"http://127.0.0.1:{http_port}/admin/login/", headers={"Host": "localhost"}, timeout=10)
        assert plain.status_code == 301 and plain.headers["location"].startswith("https://localhost")
        with httpx.Client(base_url=public, verify=ssl.create_default_context(cafile=str(pki_dir / "ca.pem")), timeout=10) as client:
            login = client.get("/admin/login/")
            assert login.status_code == 200
            cookie = login.headers["set-cookie"]
            assert "csrftoken=" in cookie and "Secure" in cookie
            assert "max-age=" in login.headers.get("strict-transport-security", "")
            # Behind the proxy every caller is loopback: the sample keeps /metrics in.
            assert client.get("/metrics").status_code == 403
            assert client.get("/v1/models").status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert httpx.get(f"{web.url}/metrics", timeout=10).status_code == 200  # direct, from loopback

