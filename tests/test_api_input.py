"""Bodies the operator API cannot read as an object are a 400 that says so,
never a 500 (``PATCH /api/v1/models/NAME/`` with ``[]`` was one)."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from accounts.services import token_create

from replicas.models import CatalogEntry
from tests.factories import CatalogEntryFactory

pytestmark = pytest.mark.django_db

NOT_OBJECTS = [("[]", "array"), ('[{"replicas": 2}]', "array"), ('"x"', "string"), ("3", "number"),
               ("true", "boolean"), ("null", "null")]


@pytest.fixture
def api(db):
    user = get_user_model().objects.create_superuser("operator", "", "operator-password-for-tests")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_create(user=user).token}")
    return client


@pytest.mark.parametrize("body, kind", NOT_OBJECTS)
@pytest.mark.parametrize("method, path", [
    ("patch", "/api/v1/models/m/"), ("put", "/api/v1/models/m/"), ("post", "/api/v1/models/"),
    ("post", "/api/v1/models/m/scale/"), ("post", "/api/v1/catalog/apply/"), ("post", "/api/v1/drains/"),
    ("post", "/api/v1/keys/"),
])
def test_a_body_that_is_not_an_object_is_a_400(api, method, path, body, kind):
    CatalogEntryFactory(name="m", replicas=1)
    before = list(CatalogEntry.objects.values())
    r = getattr(api, method)(path, data=body, content_type="application/json")
    assert r.status_code == 400, (r.status_code, r.content[:300])
    assert r.json()["detail"] == f"the body must be a JSON object, not a JSON {kind}"
    assert list(CatalogEntry.objects.values()) == before


def test_an_object_body_still_works(api):
    CatalogEntryFactory(name="m", replicas=1)
    r = api.patch("/api/v1/models/m/", data=json.dumps({"replicas": 3}), content_type="application/json")
    assert r.status_code == 200, r.content
    assert CatalogEntry.objects.get(name="m").replicas == 3


@pytest.mark.parametrize("path", ["/api/v1/drains/0.5/", "/api/v1/jobs/%C2%84/", "/api/v1/nothing/", "/api/v2/"])
def test_a_url_no_route_matches_is_a_json_404_under_the_api(api, path):
    r = api.get(path)
    assert r.status_code == 404
    assert r["Content-Type"] == "application/json"
    assert "names nothing in the operator API" in r.json()["detail"]


def test_a_url_no_route_matches_elsewhere_is_still_the_html_page(api):
    r = api.get("/no-such-page/")
    assert r.status_code == 404 and r["Content-Type"].startswith("text/html")
