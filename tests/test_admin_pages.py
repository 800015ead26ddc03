"""The Django admin: every page of every model answers (never a 500), rows
the system owns are read-only, and actions go through the services."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.urls import reverse

from core.models import Event
from nodes.choices import NodeStatus
from nodes.models import ControlPlaneClock, Fabric, Gpu, Hca, Node
from replicas import reconcile
from replicas.models import Drain, GpuAllocation, PortAllocation, Replica
from tests.factories import CatalogEntryFactory, node_with_gpus

pytestmark = pytest.mark.django_db

SYSTEM_OWNED = [Gpu, Hca, Fabric, Event, ControlPlaneClock, GpuAllocation, PortAllocation]


@pytest.fixture
def admin_client(client, no_reconcile_enqueue):
    client.force_login(get_user_model().objects.create_superuser("root", "", "pw-for-tests"))
    return client


@pytest.fixture
def cluster(pki_dir):
    from pki.services import cert_issue_client

    node_with_gpus("node01", fabric="ib-a", addr="127.0.1.1")
    node_with_gpus("node02", fabric="ib-a", addr="127.0.1.2")
    CatalogEntryFactory(name="m", nodes=1, gpus_per_node=2, replicas=2)
    reconcile.replicas_reconcile()
    ControlPlaneClock.objects.get_or_create(pk=1)
    cert_issue_client(node_id="node01")
    assert GpuAllocation.objects.exists() and PortAllocation.objects.exists() and Event.objects.exists()


def _url(model, view: str, *args) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_{view}", args=args)


def test_every_admin_page_answers_without_a_500(admin_client, cluster):
    for model, model_admin in admin.site._registry.items():
        listing = admin_client.get(_url(model, "changelist"))
        assert listing.status_code == 200, model
        added = admin_client.get(_url(model, "add"))
        assert added.status_code in (200, 403), model
        if added.status_code == 200:
            # An empty form is refused with the form's errors, never a 500.
            assert admin_client.post(_url(model, "add"), {}).status_code == 200, model
        row = model.objects.first()
        if row is not None:
            assert admin_client.get(_url(model, "change", row.pk)).status_code == 200, model
            assert admin_client.get(_url(model, "delete", row.pk)).status_code in (200, 403), model


@pytest.mark.parametrize("model", SYSTEM_OWNED, ids=lambda m: m.__name__)
def test_system_owned_rows_are_read_only(admin_client, cluster, model):
    row = model.objects.first()
    assert admin_client.get(_url(model, "add")).status_code == 403
    assert admin_client.get(_url(model, "delete", row.pk)).status_code == 403
    page = admin_client.get(_url(model, "change", row.pk))
    assert page.status_code == 200 and b'name="_save"' not in page.content  # view only


def test_a_node_name_and_fabrics_cannot_be_edited(admin_client, cluster):
    node = Node.objects.get(name="node01")
    page = admin_client.get(_url(Node, "change", node.pk))
    assert page.status_code == 200 and b'name="name"' not in page.content and b'name="fabrics"' not in page.content
    admin_client.post(_url(Node, "change", node.pk), {"name": "renamed", "fabrics": []})
    node.refresh_from_db()
    assert node.name == "node01" and list(node.fabrics.values_list("name", flat=True)) == ["ib-a"]
    assert admin_client.get(_url(Node, "add")).status_code == 403


def test_cordon_action_goes_through_the_service(admin_client, cluster):
    node = Node.objects.get(name="node02")
    admin_client.post(_url(Node, "changelist"), {"action": "cordon", "_selected_action": [node.pk]})
    node.refresh_from_db()
    assert node.status == NodeStatus.CORDONED
    assert Event.objects.filter(subject="node/node02", message__contains="cordoned").exists()


def test_adding_a_drain_starts_one_through_the_service(admin_client, cluster):
    node = Node.objects.get(name="node01")
    response = admin_client.post(_url(Drain, "add"), {"node": node.pk}, follow=True)
    assert response.status_code == 200
    drain = Drain.objects.get(node=node)
    node.refresh_from_db()
    assert node.status == NodeStatus.DRAINING and drain.remaining == 1 and drain.log
    lost = Node.objects.get(name="node02")
    Node.objects.filter(pk=lost.pk).update(status=NodeStatus.LOST)
    refused = admin_client.post(_url(Drain, "add"), {"node": lost.pk})
    assert refused.status_code == 200 and b"only a ready or cordoned node can be drained" in refused.content
    assert not Drain.objects.filter(node=lost).exists()
    assert admin_client.get(_url(Drain, "delete", drain.pk)).status_code == 403


def test_certificates_are_revoked_by_the_action_never_deleted(admin_client, cluster):
    from pki.models import Certificate

    cert = Certificate.objects.get(common_name="node01", kind="client")
    assert admin_client.get(_url(Certificate, "delete", cert.pk)).status_code == 403
    response = admin_client.post(_url(Certificate, "changelist"),
                                 {"action": "revoke", "_selected_action": [cert.pk]}, follow=True)
    assert response.status_code == 200
    cert.refresh_from_db()
    assert cert.revoked_at is not None and "admin" in cert.revocation_reason
    again = admin_client.post(_url(Certificate, "changelist"),
                              {"action": "revoke", "_selected_action": [cert.pk]}, follow=True)
    assert again.status_code == 200 and b"already revoked" in again.content
    assert Replica.objects.count() == 2  # nothing else touched


def test_names_read_as_words(admin_client):
    index = admin_client.get("/admin/").content.decode()
    assert "GPUs" in index and "HCAs" in index and "Gateway processes" in index
    assert "Gpus" not in index and "processs" not in index


def test_hypervisors_are_read_only_in_the_admin(admin_client, pki_dir):
    """The admin's form skipped the API's checks (it stored url=http://...,
    bridge='vmbr0,tag=99,firewall=0', image=/etc/shadow) and the secret rule:
    hypervisors change through the API, ctl or the pages only."""
    from provisioning.models import Hypervisor
    from provisioning.vault import secret_encrypt

    bad = {"name": "evil", "url": "http://127.0.0.9:8006", "token_id": "a@pve!t", "token_secret": "s",
           "node": "", "storage": "local-lvm", "image": "/etc/shadow", "bridge": "vmbr0,tag=99,firewall=0",
           "pool": "", "ciuser": "ubuntu", "nameserver": "", "ssh_keys": "", "ca_pem": ""}
    assert admin_client.post(_url(Hypervisor, "add"), bad).status_code == 403
    assert not Hypervisor.objects.exists()
    row = Hypervisor.objects.create(name="pve", url="https://127.0.0.1:8006", token_id="a@pve!t",
                                    token_secret_encrypted=secret_encrypt("s"), image="local:import/x.qcow2")
    assert admin_client.post(_url(Hypervisor, "change", row.pk), {**bad, "name": "pve"}).status_code == 403
    assert admin_client.post(_url(Hypervisor, "delete", row.pk), {"post": "yes"}).status_code == 403
    row.refresh_from_db()
    assert (row.url, row.bridge, row.image) == ("https://127.0.0.1:8006", "vmbr0", "local:import/x.qcow2")
    page = admin_client.get(_url(Hypervisor, "change", row.pk))
    assert page.status_code == 200 and b"token_secret" not in page.content
