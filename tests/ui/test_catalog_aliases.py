"""A catalog preview cannot be made to build gigabytes: YAML aliases are
refused before anything is built (issue 19, item 7)."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.django_db


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The probe's shape: a few KB of nested aliases that expand to width**levels values."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    lines.append("models:\n  - name: bomb\n    engine: sim\n    model: /m\n    args: *a%d" % (levels - 1))
    return "\n".join(lines) + "\n"


def test_a_viewers_preview_of_an_alias_bomb_is_refused_at_once(viewer_client):
    text = alias_bomb()
    started = time.monotonic()
    response = viewer_client.post("/catalog/", {"yaml": text})
    waited = time.monotonic() - started
    body = response.content.decode()
    assert response.status_code == 400
    assert "may not use YAML aliases" in body
    assert len(body) < 20 * len(text) + 50_000, len(body)  # the page echoes the text, nothing expanded
    assert waited < 5, waited


def test_a_merge_key_is_an_alias_too(viewer_client):
    text = ("base: &base {engine: sim, model: /m}\n"
            "models:\n  - <<: *base\n    name: merged\n")
    response = viewer_client.post("/catalog/", {"yaml": text})
    assert response.status_code == 400 and "may not use YAML aliases" in response.content.decode()


def test_a_plain_catalog_previews(viewer_client):
    response = viewer_client.post("/catalog/", {"yaml": "models:\n  - name: plain\n    engine: sim\n    model: /m\n"})
    assert response.status_code == 200 and "plain" in response.content.decode()
