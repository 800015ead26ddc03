"""Users of the web UI: a superuser (has every permission) and a viewer
(every view_ permission and nothing else, as the viewer role will have)."""

from __future__ import annotations

import pytest

PASSWORD = "ui-password-for-tests"


@pytest.fixture(autouse=True)
def _engine_user(engine_user_that_exists):
    """Onboarding here creates no user on this host (tests/conftest.py)."""


@pytest.fixture
def superuser(db):
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_superuser("root", "", PASSWORD)


@pytest.fixture
def viewer(db):
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission

    user = get_user_model().objects.create_user("watcher", "", PASSWORD)
    user.user_permissions.set(Permission.objects.filter(codename__startswith="view_"))
    return user


@pytest.fixture
def admin_client_ui(client, superuser):
    client.force_login(superuser)
    return client


@pytest.fixture
def viewer_client(client, viewer):
    client.force_login(viewer)
    return client


@pytest.fixture
def small_cluster(db, no_reconcile_enqueue):
    """Two fabrics of two nodes, a fabric-less node, a 2x4 model placed."""
    from replicas import reconcile
    from replicas.catalog import catalog_apply
    from tests.factories import node_with_gpus

    node_with_gpus("node01", fabric="ib-a", addr="127.0.1.1")
    node_with_gpus("node02", fabric="ib-a", addr="127.0.1.2")
    node_with_gpus("node03", fabric="ib-b", addr="127.0.1.3")
    node_with_gpus("node04", fabric="ib-b", addr="127.0.1.4")
    node_with_gpus("island01", addr="127.0.1.5")
    catalog_apply(entries=[
        {"name": "llama-70b", "engine": "sim", "model": "/models/70b", "nodes": 2, "gpus_per_node": 4, "replicas": 1},
        {"name": "qwen-7b", "engine": "sim", "model": "/models/7b", "nodes": 1, "gpus_per_node": 1, "replicas": 2},
    ])
    reconcile.replicas_reconcile()
