"""`llmgw up --host` beyond loopback says what that exposes and what to put in front."""

from __future__ import annotations

import pytest

from cli.up import exposure_warning


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.5", "::1", "localhost"])
def test_loopback_is_quiet(host):
    assert exposure_warning(host=host, web_port=8000) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "llmgw.example.org"])
def test_anything_else_is_warned_about(host, settings):
    settings.ALLOWED_HOSTS = ["*"]
    warning = exposure_warning(host=host, web_port=8000)
    assert warning.startswith("WARNING") and f"{host}:8000" in warning
    assert "plain HTTP" in warning and "any Host header" in warning
    assert "deploy/nginx-llmgw.conf" in warning and "docs/security.md" in warning
    settings.ALLOWED_HOSTS = ["llmgw.example.org"]
    assert "any Host header" not in exposure_warning(host=host, web_port=8000)
