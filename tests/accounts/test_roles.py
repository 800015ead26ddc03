"""Each role sees and can do exactly its share through the REST API, and a
staff user with no permissions can do nothing: one table of endpoints, every
role against every row."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from rest_framework.test import APIClient

from accounts import roles, services
from core.models import Event
from gateway.models import ApiKey
from gateway.services import key_create
from nodes.models import Node
from replicas.models import CatalogEntry, Drain
from tests.factories import CatalogEntryFactory, NodeFactory

pytestmark = pytest.mark.django_db

V, O, A = roles.VIEWER, roles.OPERATOR, roles.ADMIN
EVERYONE = {V, O, A}
OPERATORS = {O, A}
ADMINS = {A}

ENTRY = {"name": "m3", "engine": "sim", "weights": "/models/sim", "nodes": 1, "gpus_per_node": 1, "replicas": 0}

# (method, path, body, the roles that may)
TABLE = [
    ("get", "/api/v1/nodes/", None, EVERYONE),
    ("get", "/api/v1/nodes/n1/", None, EVERYONE),
    ("get", "/api/v1/fabrics/", None, EVERYONE),
    ("get", "/api/v1/events/", None, EVERYONE),
    ("get", "/api/v1/models/", None, EVERYONE),
    ("get", "/api/v1/models/m/", None, EVERYONE),
    ("get", "/api/v1/replicas/", None, EVERYONE),
    ("get", "/api/v1/drains/", None, EVERYONE),
    ("get", "/api/v1/keys/", None, EVERYONE),
    ("get", "/api/v1/keys/k/", None, EVERYONE),
    ("get", "/api/v1/certificates/", None, EVERYONE),
    ("get", "/api/v1/hypervisors/", None, EVERYONE),
    ("get", "/api/v1/jobs/", None, EVERYONE),
    ("get", "/api/v1/users/", None, EVERYONE),
    ("post", "/api/v1/nodes/n1/cordon/", None, OPERATORS),
    ("post", "/api/v1/nodes/n2/uncordon/", None, OPERATORS),
    ("post", "/api/v1/drains/", {"node": "n1"}, OPERATORS),
    ("post", "/api/v1/models/", ENTRY, OPERATORS),
    ("patch", "/api/v1/models/m/", {"replicas": 0}, OPERATORS),
    ("put", "/api/v1/models/m/", {**ENTRY, "name": "m"}, OPERATORS),
    ("post", "/api/v1/models/m/scale/", {"replicas": 3}, OPERATORS),
    ("delete", "/api/v1/models/m2/", None, OPERATORS),
    ("post", "/api/v1/catalog/apply/", {"models": [ENTRY], "prune": False}, OPERATORS),
    ("post", "/api/v1/catalog/apply/", {"models": [ENTRY], "prune": True}, OPERATORS),
    ("post", "/api/v1/keys/", {"name": "new"}, OPERATORS),
    ("post", "/api/v1/keys/k/revoke/", None, OPERATORS),
    ("patch", "/api/v1/keys/k/", {"rpm": 10, "priority": "batch"}, OPERATORS),
    ("get", "/api/v1/keys/usage/", None, EVERYONE),
    ("post", "/api/v1/hypervisors/", {"name": "pve2"}, ADMINS),
    ("patch", "/api/v1/hypervisors/nope/", {"port": 1}, ADMINS),
    ("delete", "/api/v1/hypervisors/nope/", None, ADMINS),
    ("post", "/api/v1/hypervisors/nope/check/", None, ADMINS),
    ("post", "/api/v1/certificates/revoke/", {"target": "n1"}, ADMINS),
    ("post", "/api/v1/jobs/provision/", {}, ADMINS),
    ("post", "/api/v1/jobs/999/retry/", None, ADMINS),
    ("post", "/api/v1/jobs/999/cancel/", None, ADMINS),
    ("post", "/api/v1/users/", {"username": "newcomer", "role": "viewer"}, ADMINS),
    ("post", "/api/v1/users/someone/set-role/", {"role": "admin"}, ADMINS),
]


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def cluster(db):
    NodeFactory(name="n1")
    NodeFactory(name="n2", status="cordoned")
    CatalogEntryFactory(name="m")
    CatalogEntryFactory(name="m2", replicas=0)
    key_create(name="k")
    services.user_create(actor="tests", username="someone", role=V, password="someone-password-1")


def _client(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {services.token_create(user=user).token}")
    return client


def _user(who: str):
    if who == "staff-without-permissions":
        return get_user_model().objects.create_user(who, password="x-password-1", is_staff=True)
    return services.user_create(actor="tests", username=f"the-{who}", role=who, password="x-password-1")[0]


def _state() -> tuple:
    """Everything a write in the table could change."""
    return (
        sorted(Node.objects.values_list("name", "status")),
        sorted(CatalogEntry.objects.values_list("name", "replicas")),
        sorted(ApiKey.objects.values_list("name", "revoked_at")),
        Drain.objects.count(),
        Event.objects.count(),
        sorted((u.username, sorted(g.name for g in u.groups.all())) for u in get_user_model().objects.all()),
    )


@pytest.mark.parametrize("who", [V, O, A, "staff-without-permissions"])
@pytest.mark.parametrize("method, path, body, allowed", TABLE, ids=[f"{m} {p} {b}" for m, p, b, _ in TABLE])
def test_each_role_may_do_exactly_its_share(cluster, who, method, path, body, allowed):
    client = _client(_user(who))
    before = _state()
    answer = getattr(client, method)(path, body, format="json")
    if who in allowed:
        # Past the permission check: done, or refused for what the request says (bad input, no such thing).
        assert answer.status_code not in (401, 403), (who, path, answer.content)
        assert answer.status_code < 500
        if method == "get":
            assert answer.status_code == 200, answer.content
    else:
        assert answer.status_code == 403, (who, path, answer.content)
        assert "needs the permission" in answer.json()["detail"]
        assert _state() == before


def test_without_a_token_nothing_is_answered(cluster):
    for method, path, body, _ in TABLE:
        answer = getattr(APIClient(), method)(path, body, format="json")
        assert answer.status_code == 401, path


def test_the_groups_hold_the_map():
    groups = {g.name: {f"{p.content_type.app_label}.{p.codename}" for p in g.permissions.select_related("content_type")}
              for g in Group.objects.filter(name__in=roles.ROLES)}
    assert set(groups) == set(roles.ROLES)
    views = {p for p in groups[A] if p.split(".")[1].startswith("view_")}
    assert groups[V] == views and "nodes.view_node" in views and "provisioning.view_job" in views
    assert groups[O] == views | roles.OPERATOR_PERMISSIONS
    assert {"pki.add_certificate", "pki.change_certificate", "provisioning.run_provisioning",
            "provisioning.add_hypervisor", "auth.add_user", "auth.change_user"} <= groups[A]
    assert not {"pki.add_certificate", "provisioning.run_provisioning", "auth.add_user"} & groups[O]


def test_roles_and_staff():
    viewer, _ = services.user_create(actor="tests", username="v", role=V, password="x-password-1")
    assert not viewer.is_staff
    admin = services.user_set_role(actor="tests", username="v", role=A)
    assert admin.is_staff and [g.name for g in admin.groups.all()] == [A]
    assert admin.has_perm("pki.add_certificate")
    back = services.user_set_role(actor="tests", username="v", role=O)
    assert not back.is_staff and [g.name for g in back.groups.all()] == [O]


def test_an_unmapped_action_is_refused_to_all_but_superusers(rf):
    from rest_framework.request import Request

    from accounts.permissions import ActionPermissions

    class View:
        permission_model = "nodes.node"
        action = "self_destruct"

    admin, _ = services.user_create(actor="tests", username="a", role=A, password="x-password-1")
    request = Request(rf.post("/"))
    request.user = admin
    assert ActionPermissions().has_permission(request, View()) is False
    request.user = get_user_model().objects.create_superuser("root", "", "x-password-1")
    assert ActionPermissions().has_permission(request, View()) is True
