"""The web UI in a real browser against the real web process: every page
renders its key content, passes axe-core (no serious or critical violation)
and is saved as a screenshot under var/test/screenshots/; actions change state
through the services; a viewer sees no action; a node going lost shows
without a reload."""

from __future__ import annotations

import pytest

from tests.ui.browser import accessibility_problems, browser_page, login, screenshot
from tests.ui.conftest import PASSWORD

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def page():
    with browser_page() as opened:
        yield opened


@pytest.fixture
def seeded(small_cluster, pki_dir):
    """The small cluster with a certificate, a key, a hypervisor and a failed job."""
    from django.utils import timezone

    from gateway.services import key_create
    from core.choices import EventSeverity
    from core.events import event_record
    from nodes.models import Gpu, GpuConflict, Node
    from pki.services import cert_issue_client
    from provisioning.models import Hypervisor, Job, Step

    cert_issue_client(node_id="node01")
    key_create(name="demo")
    Node.objects.filter(name="node04").update(discovery_errors=["nvidia-smi: GPU 0000:1B:00.0 has fallen off the bus"])
    Gpu.objects.filter(node__name="node04", index=7).update(missing_since=timezone.now())
    GpuConflict.objects.create(claimant=Node.objects.get(name="island01"),
                               gpu=Gpu.objects.get(node__name="node02", index=6))
    event_record(kind="node.status", subject="node/node03", message="ready -> lost: no heartbeat for 60 s",
                 severity=EventSeverity.ERROR)
    hypervisor = Hypervisor.objects.create(name="pve1", url="https://127.0.0.1:8006", token_id="llmgw@pve!ops",
                                           token_secret_encrypted="x", image="local:import/noble.qcow2")
    job = Job.objects.create(kind="provision", node_name="node09", hypervisor=hypervisor, status="failed",
                             status_reason="VMID 144 is taken", status_changed_at=timezone.now(), params={})
    Step.objects.create(job=job, index=0, name="create", title="Create the VM", status="done",
                        log=[{"at": "2026-12-01T00:00:00", "line": "cloned"}])
    Step.objects.create(job=job, index=1, name="boot", title="Boot", status="failed",
                        log=[{"at": "2026-12-01T00:00:05", "line": "VMID 144 is taken"}])


PAGES = [
    ("cluster", "/", ["ib-a", "ib-b", "no fabric", "node01", "island01", "llama-70b", "fallen off the bus",
                      "GPU 7 missing since", "GPU 6 also claimed by island01"]),
    ("node-conflict", "/nodes/node02/", ["GPU claims in conflict", "also claimed by island01"]),
    ("node", "/nodes/node01/", ["NVIDIA H200", "mlx5_0", "InfiniBand", "valid", "Cordon", "Drain"]),
    ("replicas", "/replicas/", ["llama-70b", "2 x 4 GPUs", "Scale", "node01"]),
    ("catalog", "/catalog/", ["catalog.yaml", "Preview"]),
    ("events", "/events/", ["node/node03", "no heartbeat for 60 s"]),
    ("gateway", "/gateway/", ["demo", "Create key", "llama-70b"]),
    ("provisioning", "/provisioning/", ["pve1", "node09", "Retry", "New VM", "Onboard it when it is made",
                                        "Add existing machine"]),
]


def test_every_page_renders_passes_axe_and_is_saved(seeded, superuser, web_factory, page):
    from playwright.sync_api import expect

    from replicas.models import Replica

    web = web_factory()
    login(page, web.url, "root", PASSWORD)
    wide = Replica.objects.get(model__name="llama-70b").pk
    problems = {}
    for name, path, texts in [*PAGES, ("replica", f"/replicas/{wide}/", ["Rank 0 (leader)", "Launch command"])]:
        page.goto(f"{web.url}{path}")
        for text in texts:
            expect(page.locator("main")).to_contain_text(text)
        found = accessibility_problems(page)
        if found:
            problems[name] = found
        screenshot(page, name)
    assert not problems, problems
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{web.url}/")
    screenshot(page, "cluster-phone")
    page.emulate_media(color_scheme="dark")
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(f"{web.url}/nodes/node01/")
    screenshot(page, "node-dark")


def test_actions_in_the_browser(seeded, superuser, web_factory, page):
    from playwright.sync_api import expect

    from gateway.models import ApiKey
    from nodes.models import Node
    from replicas.drain import drain_step
    from replicas.models import CatalogEntry, Drain

    web = web_factory()
    login(page, web.url, "root", PASSWORD, "/nodes/node02/")
    page.get_by_role("button", name="Cordon").click()
    expect(page.locator(".messages")).to_contain_text("node02 is cordoned")
    expect(page.locator("#node-status")).to_have_text("cordoned")
    assert Node.objects.get(name="node02").status == "cordoned"

    page.goto(f"{web.url}/nodes/node01/")
    page.get_by_role("button", name="Drain").click()
    expect(page.locator(".messages")).to_contain_text("Draining node01")
    drain_step(drain_id=Drain.objects.get(node__name="node01").pk)
    expect(page.locator("#drain-outcomes li")).not_to_have_count(0, timeout=10_000)  # the partial, no reload
    assert not accessibility_problems(page)
    screenshot(page, "node-draining")
    page.get_by_role("button", name="Cancel the drain").click()
    expect(page.locator(".messages")).to_contain_text("Drain of node01 cancelled")
    expect(page.locator("#node-status")).to_have_text("cordoned")

    page.goto(f"{web.url}/replicas/")
    row = page.locator("#models tr[data-model=qwen-7b]")
    row.get_by_label("replicas of qwen-7b").fill("3")
    row.get_by_role("button", name="Scale").click()
    expect(page.locator(".messages")).to_contain_text("qwen-7b now wants 3 replica(s)")
    assert CatalogEntry.objects.get(name="qwen-7b").replicas == 3

    page.goto(f"{web.url}/gateway/")
    page.fill("#key-name", "team-b")
    page.get_by_role("button", name="Create key").click()
    key = page.locator("#new-key-value").inner_text().strip()
    assert key.startswith(ApiKey.objects.get(name="team-b").prefix)
    page.goto(f"{web.url}/gateway/")
    expect(page.locator("#keys")).to_contain_text("team-b")
    assert key not in page.content()

    page.goto(f"{web.url}/catalog/")
    page.fill("#catalog-yaml", "models:\n  - name: bad\n    engine: turbo\n    model: /m\n")
    page.get_by_role("button", name="Preview").click()
    expect(page.locator("#errors")).to_contain_text("engine")
    expect(page.locator("#errors td.field")).to_have_text(["engine"])
    screenshot(page, "catalog-error")
    page.fill("#catalog-yaml", "models:\n  - name: fresh\n    engine: sim\n    model: /m\n")
    page.get_by_role("button", name="Preview").click()
    expect(page.locator("#changes")).to_contain_text("fresh (1 replicas)")
    screenshot(page, "catalog-preview")
    page.get_by_role("button", name="Apply these changes").click()
    expect(page.locator(".messages")).to_contain_text("Catalog applied: 1 created")
    assert CatalogEntry.objects.filter(name="fresh").exists()


def test_a_viewer_sees_no_action(seeded, viewer, web_factory, page):
    from playwright.sync_api import expect

    web = web_factory()
    login(page, web.url, "watcher", PASSWORD, "/nodes/node01/")
    expect(page.locator("h1")).to_contain_text("node01")
    for path in ("/nodes/node01/", "/replicas/", "/gateway/", "/provisioning/"):
        page.goto(f"{web.url}{path}")
        expect(page.locator("main button")).to_have_count(0)
    csrf = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    response = page.request.post(f"{web.url}/nodes/node01/cordon/", headers={"X-CSRFToken": csrf,
                                                                             "Referer": f"{web.url}/nodes/node01/"})
    assert response.status == 403 and "you may not do this" in response.text()


def test_a_node_going_lost_shows_without_a_reload(seeded, superuser, web_factory, page):
    from playwright.sync_api import expect

    from nodes.services import node_transition

    web = web_factory()
    login(page, web.url, "root", PASSWORD)
    card = page.locator("article[data-node=node03]")
    expect(card).to_have_class("node ready")
    page.evaluate("window.__not_reloaded = true")
    node_transition(node_name="node03", to="lost", reason="no heartbeat for 60 s")
    expect(card).to_have_class("node lost", timeout=15_000)
    assert page.evaluate("window.__not_reloaded") is True
    screenshot(page, "cluster-node-lost")


def test_add_existing_machine_reads_its_host_key_then_onboards(seeded, superuser, web_factory, page):
    """Against a real OpenSSH sshd on a loopback address: the key read by the
    web process, confirmed, the job listed; then the node page's certificate
    states and its Re-onboard card."""
    import datetime as dt

    from django.utils import timezone
    from playwright.sync_api import expect

    from pki.models import Certificate
    from provisioning import sshkeys
    from provisioning.models import Job
    from tests.conftest import free_port
    from tests.provisioning.sshnode import SshNode, node_root

    host = "127.0.1.223"
    machine = SshNode("onb-web", host, free_port(host), node_root("llmgw-onb-web-"), []).start()
    try:
        web = web_factory()
        login(page, web.url, "root", PASSWORD, "/provisioning/")
        form = page.locator("#add-machine")
        form.get_by_label("Node id (hostname)").fill("onb-web")
        form.get_by_label("SSH address").fill(host)
        form.get_by_label("SSH port").fill(str(machine.port))
        form.get_by_label("Fabrics, one a line").fill("ib-a:mlx5_0,mlx5_1")
        form.get_by_label("Management interface").fill("lo")
        form.get_by_role("button", name="Read host key").click()
        fingerprint = sshkeys.fingerprint(machine.host_key)
        expect(page.locator("#host-key-read")).to_have_text(fingerprint)
        expect(page.locator("#host-key")).to_contain_text("ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub")
        expect(page.locator("#add-fingerprint")).to_have_value(fingerprint)
        expect(page.locator("#add-fabrics")).to_have_value("ib-a:mlx5_0,mlx5_1")
        assert not Job.objects.filter(node_name="onb-web").exists()
        problems = accessibility_problems(page)
        screenshot(page, "provisioning-host-key")
        page.get_by_label("I compared it with the fingerprint on the machine's console").check()
        page.locator("#add-machine").get_by_role("button", name="Onboard", exact=True).click()
        job = Job.objects.get(node_name="onb-web")
        expect(page.locator(".messages")).to_contain_text(f"Job {job.pk} queued: onboard onb-web")
        expect(page.locator(f"#jobs tr[data-job='{job.pk}']")).to_contain_text("onboard")
        assert job.params["host_key_fingerprint"] == fingerprint and job.params["addr"] == host
        assert job.params["fabrics"] == [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]}]
        screenshot(page, "provisioning-onboarded")
    finally:
        machine.remove()

    # node01: its live certificate (from the seeds) and an older one it superseded.
    now, live = timezone.now(), Certificate.objects.get(common_name="node01")
    Certificate.objects.create(serial="0ld5e41", common_name="node01", kind="client", pem="-",
                               not_before=now - dt.timedelta(days=60), not_after=now - dt.timedelta(days=30),
                               fingerprint_sha256="0" * 64, revoked_at=now - dt.timedelta(days=40),
                               revocation_reason=f"superseded by {live.serial}")
    page.goto(f"{web.url}/nodes/node01/")
    expect(page.locator("#certificates")).to_contain_text(f"superseded by {live.serial}")
    expect(page.locator("#cert-rotation")).to_contain_text("two thirds of its lifetime")
    page.locator("#reonboard summary").click()
    expect(page.get_by_label("SSH address")).to_have_value("127.0.1.1")
    problems += accessibility_problems(page)
    screenshot(page, "node-reonboard")
    assert not problems, problems
