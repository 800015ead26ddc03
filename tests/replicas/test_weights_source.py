"""A catalog entry's weights source, resolved once at apply into a manifest
(files, sizes, sha256); a source that cannot be resolved is a clear error
then, and nothing changes. Against loopback servers (tests/weightservers.py)
speaking HTTP with a manifest and the hub API huggingface_hub uses."""

import hashlib

import pytest

from rest_framework.test import APIClient

from accounts import roles, services
from replicas.catalog import CatalogInvalid, catalog_apply
from replicas.models import CatalogEntry
from replicas.weights import source_problems
from tests.weightservers import WeightsServer

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]

BIG = bytes(range(256)) * 40  # 10 KiB: kept in LFS
CONFIG = b'{"architectures": ["LlamaForCausalLM"]}'  # small: kept in git
FILES = {"config.json": CONFIG, "model-00001-of-00002.safetensors": BIG, "model-00002-of-00002.safetensors": BIG[::-1]}


def entry(**source):
    return {"name": "m", "engine": "sim", "model": "/models/m", "replicas": 0, "source": source}


@pytest.fixture
def server():
    with WeightsServer() as s:
        yield s


def test_hf_source_resolves_through_huggingface_hub_to_a_pinned_manifest(server, settings):
    commit = server.add_repo("org/m", FILES)
    settings.LLMGW_HF_ENDPOINT = server.url
    catalog_apply(entries=[entry(kind="hf", repo="org/m", revision="main")])
    manifest = CatalogEntry.objects.get(name="m").manifest
    assert manifest["kind"] == "hf" and manifest["revision"] == commit  # the branch pinned to its commit
    assert [f["name"] for f in manifest["files"]] == sorted(FILES)
    for f in manifest["files"]:
        assert f["size"] == len(FILES[f["name"]])
        assert f["sha256"] == hashlib.sha256(FILES[f["name"]]).hexdigest()  # LFS and git files alike
        assert f["url"] == f"{server.url}/org/m/resolve/{commit}/{f['name']}"
    assert manifest["total_bytes"] == sum(map(len, FILES.values()))
    # Resolved once: applying the same source again reads nothing.
    before = len(server.requests)
    assert catalog_apply(entries=[entry(kind="hf", repo="org/m", revision="main")])["unchanged"] == ["m"]
    assert len(server.requests) == before


def test_hf_source_endpoint_of_its_own_is_a_mirror(server, settings):
    server.add_repo("org/m", FILES)
    settings.LLMGW_HF_ENDPOINT = "http://127.0.0.1:9"  # nothing there
    catalog_apply(entries=[entry(kind="hf", repo="org/m", revision="main", endpoint=server.url)])
    assert CatalogEntry.objects.get(name="m").manifest["endpoint"] == server.url


@pytest.mark.parametrize(("source", "words"), [
    ({"repo": "org/nothing", "revision": "main"}, "no such repository"),
    ({"repo": "org/m", "revision": "v9"}, "no such revision"),
    ({"repo": "org/m", "revision": "main", "endpoint": "http://127.0.0.1:9"}, "cannot reach the hub"),
])
def test_unresolvable_hf_source_is_refused_at_apply_and_nothing_changes(server, settings, source, words):
    server.add_repo("org/m", FILES)
    settings.LLMGW_HF_ENDPOINT = server.url
    catalog_apply(entries=[dict(entry(), name="keep", source={})])
    with pytest.raises(CatalogInvalid) as caught:
        catalog_apply(entries=[entry(kind="hf", **source)], prune=True)
    assert any(e.startswith("m: source: ") and words in e for e in caught.value.errors), caught.value.errors
    assert list(CatalogEntry.objects.values_list("name", flat=True)) == ["keep"]
    assert not CatalogEntry.objects.get(name="keep").removing


def test_http_source_with_a_manifest(server):
    url = server.add_files("m", FILES, revision="2026-12-01")
    catalog_apply(entries=[entry(kind="http", url=url)])
    manifest = CatalogEntry.objects.get(name="m").manifest
    assert manifest["revision"] == "2026-12-01"
    assert {f["name"]: (f["size"], f["url"]) for f in manifest["files"]} == {
        n: (len(d), url + n) for n, d in FILES.items()}


@pytest.mark.parametrize(("breakage", "words"), [
    ("missing", "answered HTTP 404"),
    ("dotdot", "not a relative path"),
    ("shape", "not a list of files"),
])
def test_unresolvable_http_source_is_refused(server, breakage, words):
    url = server.add_files("m", FILES)
    if breakage == "missing":
        del server.files["/files/m/manifest.json"]
    elif breakage == "dotdot":
        server.files["/files/m/manifest.json"] = b'{"files": [{"name": "../etc/passwd", "size": 1, "sha256": "%s"}]}' % (
            b"0" * 64)
    else:
        server.files["/files/m/manifest.json"] = b'{"files": "all of them"}'
    with pytest.raises(CatalogInvalid) as caught:
        catalog_apply(entries=[entry(kind="http", url=url)])
    assert any(words in e for e in caught.value.errors), caught.value.errors
    assert not CatalogEntry.objects.exists()


def test_air_gapped_cluster_refuses_a_source_outside_its_mirrors(server, settings):
    settings.LLMGW_WEIGHTS_ALLOWED_HOSTS = ["mirror.internal"]
    url = server.add_files("m", FILES)
    with pytest.raises(CatalogInvalid) as caught:
        catalog_apply(entries=[entry(kind="http", url=url)])
    assert "LLMGW_WEIGHTS_ALLOWED_HOSTS" in caught.value.errors[0]


def test_shared_path_and_hand_placed_sources_list_nothing_to_copy():
    catalog_apply(entries=[entry(kind="path", path="/shared/m"), dict(entry(kind="none"), name="byhand")])
    assert CatalogEntry.objects.get(name="m").manifest == {
        "kind": "path", "revision": "local", "path": "/shared/m", "files": [], "total_bytes": 0}
    assert CatalogEntry.objects.get(name="byhand").manifest["path"] == "/models/m"


@pytest.mark.parametrize(("source", "words"), [
    ({"kind": "s3"}, "kind must be one of"),
    ({"kind": "hf", "repo": "org/m"}, "needs 'revision'"),
    ({"kind": "hf", "repo": "no-slash", "revision": "main"}, "not a repository id"),
    ({"kind": "http", "url": "ftp://x/"}, "not an http"),
    ({"kind": "path", "path": "relative/dir"}, "absolute"),
    ({"kind": "path", "path": "/a/../b"}, "normalised"),
    ("hf", "must be a mapping"),
])
def test_malformed_source_names_the_problem(source, words):
    assert any(words in p for p in source_problems(source)), source_problems(source)
    with pytest.raises(CatalogInvalid) as caught:
        catalog_apply(entries=[{"name": "m", "engine": "sim", "model": "/m", "source": source}])
    assert any(": source: " in e and words in e for e in caught.value.errors), caught.value.errors


@pytest.mark.parametrize(("source", "line"), [
    ({"kind": "hf", "repo": "org/m", "reivsion": "main"}, "source.reivsion: unknown key; did you mean revision?"),
    ({"kind": "hf", "repo": "org/m", "revision": "main", "endpont": "http://mirror/"},
     "source.endpont: unknown key; did you mean endpoint?"),
    ({"kind": "http", "url": "http://files/m/", "manfest": "http://files/m.json"},
     "source.manfest: unknown key; did you mean manifest?"),
    ({"kind": "path", "pth": "/shared/m"}, "source.pth: unknown key; did you mean path?"),
    ({"knid": "path", "path": "/shared/m"}, "source.knid: unknown key; did you mean kind?"),
    # No close key: the kind's keys are listed; a key of another kind is unknown to this one.
    ({"kind": "hf", "repo": "org/m", "revision": "main", "token": "x"},
     "source.token: unknown key; the keys here are endpoint, kind, repo, revision"),
    ({"kind": "path", "path": "/shared/m", "url": "http://files/m/"},
     "source.url: unknown key; the keys here are kind, path"),
])
def test_an_unknown_source_key_is_refused_with_the_close_known_one(source, line):
    """The source is free-form JSON to the serializer, so core.strict does not
    walk it; its keys per kind are refused the same way (issue 25)."""
    with pytest.raises(CatalogInvalid) as caught:
        catalog_apply(entries=[{"name": "m", "engine": "sim", "model": "/m", "source": source}])
    assert caught.value.errors == [f"models[0] (m): {line}"]
    assert line.removeprefix("source.") in source_problems(source)
    assert not CatalogEntry.objects.exists()


def test_spares_need_a_source():
    with pytest.raises(CatalogInvalid) as caught:
        catalog_apply(entries=[{"name": "m", "engine": "sim", "model": "/m", "spares": 1}])
    assert any(": spares: " in e for e in caught.value.errors)


def test_rest_api_answers_400_naming_the_source(server, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    user, _ = services.user_create(actor="tests", username="op", role=roles.OPERATOR, password="pw-for-the-tests-1")
    operator = APIClient()
    operator.credentials(HTTP_AUTHORIZATION=f"Token {services.token_create(user=user).token}")
    answer = operator.post("/api/v1/catalog/apply/",
                           {"models": [entry(kind="http", url=server.url + "/files/none/")]}, format="json")
    assert answer.status_code == 400
    assert "m: source: " in answer.json()["detail"] and "HTTP 404" in answer.json()["detail"]
    url = server.add_files("m", FILES)
    answer = operator.post("/api/v1/models/", entry(kind="http", url=url, manifets=url + "manifest.json"),
                           format="json")
    assert answer.status_code == 400
    assert "source.manifets: unknown key; did you mean manifest?" in answer.json()["detail"]
    assert not CatalogEntry.objects.exists()
    answer = operator.post("/api/v1/models/", entry(kind="http", url=url), format="json")
    assert answer.status_code == 201, answer.content
    assert answer.json()["source"] == {"kind": "http", "url": url}
    assert answer.json()["weights_bytes"] == sum(map(len, FILES.values())) and answer.json()["weights_revision"]
