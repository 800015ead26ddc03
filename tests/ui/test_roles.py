"""Each role sees and can do exactly its share through the web pages: a user
per role made by ``accounts.services.user_create``, logged in through the
login page. One table of actions (every role against every row, through
Django's test client) and one of what each role's pages show; the browser
test checks the same in Chromium for a few pages per role."""

from __future__ import annotations

import pytest

from accounts import roles
from core.models import Event
from nodes.models import Node

V, O, A = roles.VIEWER, roles.OPERATOR, roles.ADMIN
OPERATORS, ADMINS = {O, A}, {A}
PASSWORD = "role-password-for-tests"
FINGERPRINT = "SHA256:" + "Q" * 43

# (POST path, form, the roles that may, what the action's Event says when it is done: None if it writes none here)
ACTIONS = [
    ("/nodes/node01/cordon/", {}, OPERATORS, "cordoned by user the-{who}"),
    ("/nodes/node04/uncordon/", {}, OPERATORS, "by user the-{who}"),
    ("/nodes/node01/drain/", {}, OPERATORS, "drain requested by user the-{who}"),
    ("/nodes/node03/drain/cancel/", {}, OPERATORS, "cancelled by user the-{who}"),
    ("/models/qwen-7b/scale/", {"replicas": "3"}, OPERATORS, "qwen-7b scaled from 2 to 3 by user the-{who}"),
    ("/catalog/apply/", {"yaml": "models:\n  - name: fresh\n    engine: sim\n    model: /m\n"}, OPERATORS,
     "catalog: fresh created by user the-{who}"),
    ("/gateway/keys/", {"name": "team-z"}, OPERATORS, "created by user the-{who}"),
    ("/gateway/keys/demo/revoke/", {}, OPERATORS, "API key demo revoked by user the-{who}"),
    ("/gateway/keys/demo/limits/", {"rpm": "60", "priority": "batch"}, OPERATORS,
     "API key demo changed by user the-{who}: rpm=60"),
    ("/nodes/node01/revoke/", {"reason": "stolen"}, ADMINS, "revoked by user the-{who}: stolen"),
    ("/provisioning/vm/", {"node": "node09", "hypervisor": "pve1", "vmid": "144", "ip": "10.0.0.144/24",
                           "gateway": "10.0.0.1", "cores": "8", "memory": "16384", "disk": "200G"}, ADMINS,
     "queued by the-{who}"),
    ("/provisioning/onboard/", {"node": "node09", "addr": "127.0.1.99", "host_key_fingerprint": FINGERPRINT,
                                "confirmed": "on", "step": "onboard"}, ADMINS,
     "onboard node09 at 127.0.1.99 (fabrics none (island)) queued by the-{who}"),
    ("/nodes/node01/reonboard/", {"addr": "127.0.1.1", "fabrics": "ib-a", "host_key_fingerprint": FINGERPRINT},
     ADMINS, "onboard node01 at 127.0.1.1 (fabrics ib-a:mlx5_0,mlx5_1) queued by the-{who}"),
    ("/provisioning/jobs/{failed}/retry/", {}, ADMINS, "retried by user the-{who}"),
    ("/provisioning/jobs/{queued}/cancel/", {}, ADMINS, "cancelled by user the-{who}"),
]


@pytest.fixture
def fast_passwords(settings):
    """For the test client only: the web process the browser talks to keeps
    the site's hashers, so users it logs in are made with those."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def role_cluster(small_cluster, pki_dir):
    """The small cluster, with something for every action to act on: node04
    cordoned, node03 draining, a key, a certificate, a hypervisor, a failed
    and a queued job, and a user per role."""
    from django.utils import timezone

    from accounts.services import user_create
    from gateway.services import key_create
    from nodes.services import node_cordon
    from pki.services import cert_issue_client
    from provisioning.models import Hypervisor, Job
    from replicas.drain import drain_start

    node_cordon(node_name="node04")
    drain_start(node_name="node03")
    key_create(name="demo")
    cert_issue_client(node_id="node01")
    hypervisor = Hypervisor.objects.create(name="pve1", url="https://127.0.0.1:8006", token_id="llmgw@pve!ops",
                                           token_secret_encrypted="x", image="local:import/noble.qcow2")
    jobs = {
        status: Job.objects.create(kind="provision", node_name=f"old-{status}", hypervisor=hypervisor, status=status,
                                   status_changed_at=timezone.now(), params={}).pk
        for status in ("failed", "queued")
    }
    for who in roles.ROLES:
        user_create(actor="tests", username=f"the-{who}", role=who, password=PASSWORD)
    return jobs


def _log_in(client, who: str):
    answer = client.post("/login/", {"username": f"the-{who}", "password": PASSWORD})
    assert answer.status_code == 302, answer.content.decode()[:500]
    return client


def _state() -> tuple:
    from gateway.models import ApiKey
    from pki.models import Certificate
    from provisioning.models import Job
    from replicas.models import CatalogEntry, Drain

    return (
        sorted(Node.objects.values_list("name", "status")),
        sorted(CatalogEntry.objects.values_list("name", "replicas")),
        sorted(ApiKey.objects.values_list("name", "revoked_at")),
        sorted(Drain.objects.values_list("pk", "status")),
        sorted(Certificate.objects.values_list("serial", "revoked_at")),
        sorted(Job.objects.values_list("pk", "status")),
        Event.objects.count(),
    )


@pytest.mark.django_db
@pytest.mark.parametrize("who", roles.ROLES)
@pytest.mark.parametrize("path, form, allowed, says", ACTIONS, ids=[a[0] for a in ACTIONS])
def test_each_role_may_do_exactly_its_share_from_the_pages(fast_passwords, client, role_cluster, who, path, form,
                                                           allowed, says):
    _log_in(client, who)
    path = path.format(**role_cluster)
    before = _state()
    last_event = Event.objects.order_by("-pk").values_list("pk", flat=True).first()
    answer = client.post(path, form)
    if who in allowed:
        assert answer.status_code in (201, 302), (who, path, answer.status_code, answer.content.decode()[-800:])
        messages = list(Event.objects.filter(pk__gt=last_event).values_list("message", flat=True))
        assert any(says.format(who=who) in m for m in messages), (who, path, messages)
    else:
        assert answer.status_code == 403, (who, path, answer.status_code)
        assert _state() == before


# (page, what marks an action on it, the roles that see it)
SEES = [
    ("/nodes/node01/", 'action="/nodes/node01/cordon/"', OPERATORS),
    ("/nodes/node01/", 'action="/nodes/node01/drain/"', OPERATORS),
    ("/nodes/node03/", 'action="/nodes/node03/drain/cancel/"', OPERATORS),
    ("/nodes/node04/", 'action="/nodes/node04/uncordon/"', OPERATORS),
    ("/nodes/node01/", "Revoke the certificate of node01", ADMINS),
    ("/replicas/", 'action="/models/qwen-7b/scale/"', OPERATORS),
    ("/gateway/", "Create key", OPERATORS),
    ("/gateway/", 'action="/gateway/keys/demo/revoke/"', OPERATORS),
    ("/gateway/", 'action="/gateway/keys/demo/limits/"', OPERATORS),
    ("/provisioning/", 'id="new-vm"', ADMINS),
    ("/provisioning/", 'id="add-machine"', ADMINS),
    ("/nodes/node01/", 'action="/nodes/node01/reonboard/"', ADMINS),
    ("/provisioning/", "/retry/", ADMINS),
    ("/provisioning/", "/cancel/", ADMINS),
]
PAGES = ["/", "/nodes/node01/", "/replicas/", "/catalog/", "/events/", "/gateway/", "/provisioning/"]


@pytest.mark.django_db
@pytest.mark.parametrize("who", roles.ROLES)
def test_each_role_sees_every_page_and_exactly_its_actions(fast_passwords, client, role_cluster, who):
    _log_in(client, who)
    for path in PAGES:
        assert client.get(path).status_code == 200, (who, path)
    for path, mark, allowed in SEES:
        body = client.get(path).content.decode()
        assert (mark in body) == (who in allowed), (who, path, mark)
    preview = client.post("/catalog/", {"yaml": "models:\n  - name: fresh\n    engine: sim\n    model: /m\n"})
    assert ("Apply these changes" in preview.content.decode()) == (who in OPERATORS), who


# (page, the button, the roles that see it)
BUTTONS = [
    ("/nodes/node01/", "Cordon", OPERATORS),
    ("/nodes/node03/", "Cancel the drain", OPERATORS),
    ("/nodes/node01/", "Revoke the certificate of node01", ADMINS),
    ("/gateway/", "Create key", OPERATORS),
    ("/provisioning/", "Provision", ADMINS),
    ("/provisioning/", "Read host key", ADMINS),
    ("/nodes/node01/", "Re-onboard node01", ADMINS),
    ("/provisioning/", "Retry", ADMINS),
]
# (a POST each role below the one that may is refused, the roles refused)
REFUSED = [("/nodes/node01/cordon/", {V}), ("/nodes/node01/revoke/", {V, O}), ("/provisioning/vm/", {V, O}),
           ("/provisioning/onboard/", {V, O}), ("/nodes/node01/reonboard/", {V, O})]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("who", roles.ROLES)
def test_each_role_in_the_browser(role_cluster, web_factory, who):
    from playwright.sync_api import expect

    from tests.ui.browser import browser_page, login

    web = web_factory()
    with browser_page() as page:
        login(page, web.url, f"the-{who}", PASSWORD, "/nodes/node01/")
        expect(page.locator(".who")).to_contain_text(f"the-{who}")
        for path, name, allowed in BUTTONS:
            page.goto(f"{web.url}{path}")
            expect(page.locator("main h1")).to_be_visible()
            # include_hidden: the certificate's button sits in a closed <details>.
            button = page.locator("main").get_by_role("button", name=name, exact=True, include_hidden=True)
            expect(button).to_have_count(1 if who in allowed else 0)
        if who == V:
            for path in ("/nodes/node01/", "/replicas/", "/gateway/", "/provisioning/"):
                page.goto(f"{web.url}{path}")
                expect(page.locator("main button")).to_have_count(0)
        csrf = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
        for path, refused in REFUSED:
            if who in refused:
                answer = page.request.post(f"{web.url}{path}", headers={"X-CSRFToken": csrf, "Referer": f"{web.url}/"})
                assert answer.status == 403, (who, path, answer.status)
    assert Node.objects.get(name="node01").status == "ready"
