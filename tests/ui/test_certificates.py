"""A node's certificates on its page: each one's state (valid, superseded
by the serial that renewed it, revoked with its reason, expired) and when
the agent renews the live one, or that its renewal is overdue. The states
come from a pure function (ui/certificates.py), tested here on its own too."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pytest
from django.utils import timezone

from ui.certificates import cert_states, renew_at


def _cert(node: str, serial: str, *, start: dt.timedelta, end: dt.timedelta, revoked: str | None = None):
    from pki.models import Certificate

    now = timezone.now()
    return Certificate.objects.create(
        serial=serial, common_name=node, kind="client", not_before=now + start, not_after=now + end,
        fingerprint_sha256=serial.ljust(64, "0"), pem="-", revoked_at=now - dt.timedelta(days=1) if revoked else None,
        revocation_reason=revoked or "")


def _row(page: str, serial: str) -> str:
    return page.split(f'data-serial="{serial}"')[1].split("</tr>")[0]


@pytest.mark.django_db
def test_certificate_states_and_an_overdue_renewal_on_the_node_page(admin_client_ui, small_cluster):
    day = dt.timedelta(days=1)
    _cert("node01", "a1", start=-90 * day, end=-60 * day)
    _cert("node01", "a2", start=-60 * day, end=-30 * day, revoked="superseded by a3")
    _cert("node01", "a3", start=-40 * day, end=20 * day, revoked="key on a stolen disk")
    _cert("node01", "a4", start=-25 * day, end=5 * day)  # two thirds were at -5 days: overdue
    page = admin_client_ui.get("/nodes/node01/").content.decode()
    assert ">expired</span>" in _row(page, "a1")
    assert ">superseded</span>" in _row(page, "a2") and ">by a3<" in _row(page, "a2")
    assert ">revoked</span>" in _row(page, "a3") and "key on a stolen disk" in _row(page, "a3")
    assert ">valid</span>" in _row(page, "a4") and "current" in _row(page, "a4")
    rotation = page.split('id="cert-rotation"')[1].split("</p>")[0]
    assert "renewal overdue" in rotation and "a4" in rotation and "systemctl status llmgw-agent" in rotation
    assert "re-onboard" in rotation


@pytest.mark.django_db
def test_a_certificate_renewed_on_time_says_when(admin_client_ui, small_cluster):
    day = dt.timedelta(days=1)
    live = _cert("node02", "b2", start=-3 * day, end=27 * day)
    _cert("node02", "b1", start=-33 * day, end=-3 * day + dt.timedelta(hours=1), revoked="superseded by b2")
    page = admin_client_ui.get("/nodes/node02/").content.decode()
    rotation = page.split('id="cert-rotation"')[1].split("</p>")[0]
    assert "renewal overdue" not in rotation
    assert f"renews <span class=\"mono\">b2</span> at\n{renew_at(live.not_before, live.not_after):%Y-%m-%d %H:%M}" \
        in rotation
    _cert("node03", "c1", start=-10 * day, end=-1 * day)
    lapsed = admin_client_ui.get("/nodes/node03/").content.decode()
    assert "No valid certificate" in lapsed.split('id="cert-rotation"')[1].split("</p>")[0]


def _c(serial, start_days, end_days, revoked_reason=None, now=dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)):
    return SimpleNamespace(serial=serial, not_before=now + dt.timedelta(days=start_days),
                           not_after=now + dt.timedelta(days=end_days),
                           revoked_at=now if revoked_reason is not None else None,
                           revocation_reason=revoked_reason or "")


def test_cert_states_is_a_pure_function_of_the_rows_and_the_time():
    now = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    rows, renewal = cert_states([_c("n", -10, 20), _c("o", -40, -10, "superseded by n")], now=now)
    assert [(r.serial, r.state, r.live) for r in rows] == [("n", "valid", True), ("o", "superseded", False)]
    assert rows[1].detail == "by n"
    assert renewal.renew_at == now + dt.timedelta(days=10) and not renewal.overdue
    assert cert_states([_c("n", -10, 20)], now=now + dt.timedelta(days=10))[1].overdue  # exactly at two thirds
    assert not cert_states([_c("n", -10, 20)], now=now + dt.timedelta(days=9, hours=23))[1].overdue
    # A newer certificate exists (revoked since): the live one is not what the agent renews from.
    later = now + dt.timedelta(days=15)
    assert not cert_states([_c("n", -10, 20), _c("m", -1, 29, "compromised")], now=later)[1].overdue
    rows, renewal = cert_states([_c("x", -30, -1), _c("y", -5, 25, "")], now=now)
    assert [r.state for r in rows] == ["expired", "revoked"] and renewal is None
