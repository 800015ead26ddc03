"""The agent fetches a catalog entry's ``kind: hf`` source itself, through
the hub's resolve URLs the control plane's manifest names (issue 22): from
the loopback hub (tests/weightservers.py), directly or redirected to a CDN
as the hub does for LFS files. A private or gated repository needs the
agent's own token (``weights.hf_token_file``), which goes to the hub's
origin only: never to the CDN a resolve URL redirects to, never to another
source. Without it, or with one that does not grant the repository, the
node reports why in its heartbeat's cache report."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from agent.config import ConfigError, load_config
from agent.protocol import DesiredWeights, WeightsFile
from agent.weights import WeightsCache, WeightsConfig
from cli.wait import wait_until
from replicas.catalog import catalog_apply
from replicas.models import CatalogEntry
from tests.weightservers import WeightsServer

from .conftest import write_yaml

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]

TOKEN = "hf_loopbackTokenForTheTests0123456789"
BIG = bytes(range(256)) * 40  # 10 KiB: kept in LFS
CONFIG = b'{"architectures": ["LlamaForCausalLM"]}'  # small: kept in git
FILES = {"config.json": CONFIG, "model-00001-of-00002.safetensors": BIG,
         "model-00002-of-00002.safetensors": BIG[::-1]}


@pytest.fixture
def hub():
    with WeightsServer() as s:
        yield s


@pytest.fixture
def cdn():
    # Another host, as the hub's CDN is: 127.0.0.2 is loopback too.
    with WeightsServer(host="127.0.0.2") as s:
        yield s


def applied(hub: WeightsServer, settings, *, token: str = "") -> DesiredWeights:
    """The control plane resolves the source at apply (with its own token);
    the node is told the manifest's files, as replicas.weights_cache does."""
    settings.LLMGW_HF_ENDPOINT = hub.url
    settings.LLMGW_HF_TOKEN = token
    catalog_apply(entries=[{"name": "m", "engine": "sim", "model": "/models/m", "replicas": 0,
                            "source": {"kind": "hf", "repo": "org/m", "revision": "main"}}])
    manifest = CatalogEntry.objects.get(name="m").manifest
    return DesiredWeights(model="m", revision=manifest["revision"], files=[
        WeightsFile(**{k: f[k] for k in ("name", "size", "sha256", "url")}) for f in manifest["files"]])


def cache(tmp_path: Path, hub: WeightsServer, token: str | None = None) -> WeightsCache:
    token_file = None
    if token is not None:
        token_file = tmp_path / "hf-token"
        token_file.write_text(token + "\n")
    return WeightsCache(WeightsConfig(cache_dir=tmp_path / "cache", budget_bytes=10**9, hf_endpoint=hub.url,
                                      hf_token_file=token_file))


def resolve_paths(w: DesiredWeights) -> set[str]:
    return {f"/org/m/resolve/{w.revision}/{name}" for name in FILES}


@pytest.mark.parametrize("through_cdn", [False, True], ids=["hub", "cdn"])
def test_agent_fetches_an_hf_source_through_the_hubs_resolve_urls(hub, cdn, settings, tmp_path, through_cdn):
    commit = hub.add_repo("org/m", FILES)
    if through_cdn:
        hub.cdn = cdn
    w = applied(hub, settings)
    assert w.revision == commit
    c = cache(tmp_path, hub)
    try:
        c.sync([w], in_use=set())
        wait_until(lambda: c.local_path(w.key) is not None, timeout=30, message="weights complete")
        path = Path(c.local_path(w.key))
        for name, data in FILES.items():
            assert (path / name).read_bytes() == data
    finally:
        c.close()
    gets = {p for method, p, _ in hub.requests if method == "GET"}
    assert resolve_paths(w) <= gets  # the agent asked the hub for each file at the pinned commit
    lfs = {f"/cdn/{hashlib.sha256(d).hexdigest()}" for n, d in FILES.items() if n.endswith(".safetensors")}
    assert set(cdn.served) == (lfs if through_cdn else set())
    # A public repository: no token anywhere.
    assert not any(auth for _, auth in hub.authorizations + cdn.authorizations)


def test_gated_repo_is_fetched_with_the_agents_token_sent_to_the_hub_only(hub, cdn, settings, tmp_path, caplog):
    hub.add_repo("org/m", FILES, token=TOKEN)
    hub.cdn = cdn
    w = applied(hub, settings, token=TOKEN)
    # Another source on the node (kind http, elsewhere) must never see the token.
    with WeightsServer(host="127.0.0.3") as files:
        base = files.add_files("other", {"w.bin": BIG})
        other = DesiredWeights(model="other", revision="r1", files=[
            WeightsFile(name="w.bin", size=len(BIG), sha256=hashlib.sha256(BIG).hexdigest(), url=base + "w.bin")])
        hub.authorizations.clear()
        caplog.set_level(logging.DEBUG)
        c = cache(tmp_path, hub, token=TOKEN)
        try:
            c.sync([w, other], in_use=set())
            wait_until(lambda: c.local_path(w.key) and c.local_path(other.key), timeout=30, message="both complete")
            for name, data in FILES.items():
                assert (Path(c.local_path(w.key)) / name).read_bytes() == data
        finally:
            c.close()
        assert files.authorizations and not any(auth for _, auth in files.authorizations)
    to_hub = {path: auth for path, auth in hub.authorizations}
    assert {p: to_hub.get(p) for p in resolve_paths(w)} == {p: f"Bearer {TOKEN}" for p in resolve_paths(w)}
    # The hub redirected the LFS files to its CDN: they arrived, without the token.
    assert len(cdn.served) == 2 and cdn.authorizations
    assert not any(auth for _, auth in cdn.authorizations)
    assert TOKEN not in caplog.text  # never logged


@pytest.mark.parametrize(("token", "words"), [
    (None, "HTTP 401 from the hub: the repository is private or gated; give this agent a token that may read it "
           "(weights.hf_token_file in agent.yaml)"),
    ("hf_notTheRightOne", "HTTP 401 from the hub: the token in "),
])
def test_gated_repo_without_a_token_that_grants_it_is_refused_with_the_reason(hub, settings, tmp_path, token, words):
    hub.add_repo("org/m", FILES, token=TOKEN)
    w = applied(hub, settings, token=TOKEN)  # the control plane's token grants it; the node's does not
    c = cache(tmp_path, hub, token=token)
    try:
        c.sync([w], in_use=set())

        def error() -> str:
            (entry,) = c.report().models
            return entry.error

        wait_until(lambda: words in error(), timeout=30, message=f"the report says {words!r}")
        assert c.local_path(w.key) is None
        (entry,) = c.report().models
        assert (entry.complete, entry.bytes) == (False, 0)
        if token:
            assert "may not read this repository" in entry.error
    finally:
        c.close()


def test_a_missing_token_file_is_reported_and_the_token_placed_later_is_used_without_a_restart(
        hub, settings, tmp_path):
    hub.add_repo("org/m", FILES, token=TOKEN)
    w = applied(hub, settings, token=TOKEN)
    c = cache(tmp_path, hub, token=TOKEN)
    token_file = c.config.hf_token_file
    try:
        token_file.unlink()
        c.sync([w], in_use=set())
        wait_until(lambda: "cannot read weights.hf_token_file" in c.report().models[0].error
                   and c.report().downloads == 0, timeout=30, message="the missing token file reported")
        assert c.local_path(w.key) is None
        token_file.write_text(TOKEN)
        c.sync()  # the agent's next heartbeat
        wait_until(lambda: c.local_path(w.key) is not None, timeout=30, message="weights complete")
    finally:
        c.close()


# --- agent.yaml ------------------------------------------------------------------------------------


@pytest.fixture
def config_path(sim_node):
    return sim_node("node01", server="https://127.0.0.1:7443", gpus=1)


def test_hub_token_setting_of_the_agent_config(config_path, tmp_path):
    write_yaml(config_path, weights={"cache_dir": str(tmp_path / "c"), "budget": "1T"})
    weights = load_config(config_path).weights
    assert (weights.hf_endpoint, weights.hf_token_file) == ("https://huggingface.co", None)
    (config_path.parent / "hf-token").write_text(TOKEN + "\n")
    write_yaml(config_path, weights={"hf_token_file": "hf-token", "hf_endpoint": "https://hf-mirror.internal/"})
    weights = load_config(config_path).weights
    assert weights.hf_token_file == config_path.parent / "hf-token"  # relative: to agent.yaml
    assert weights.hf_endpoint == "https://hf-mirror.internal"
    assert TOKEN not in repr(weights)  # the config holds where the token is, not the token


@pytest.mark.parametrize(("section", "content", "words"), [
    ({"hf_token_file": "nothing-here"}, None, "weights.hf_token_file: "),
    ({"hf_token_file": "hf-token"}, "\n", "weights.hf_token_file: "),
    ({"hf_token_file": "hf-token"}, "two\nlines", "weights.hf_token_file: "),
    ({"hf_endpoint": "ftp://hub"}, None, "weights.hf_endpoint: 'ftp://hub' is not an http(s) URL"),
    ({"hf_endpoint": "https://user:pw@hub"}, None, "weights.hf_endpoint: "),
    ({"hf_tokenfile": "hf-token"}, None, "weights.hf_tokenfile: unknown key; did you mean 'hf_token_file'?"),
])
def test_hub_settings_are_checked_at_start(config_path, tmp_path, section, content, words):
    if content is not None:
        (config_path.parent / "hf-token").write_text(content)
    write_yaml(config_path, weights={"cache_dir": str(tmp_path / "c"), "budget": "1T", **section})
    with pytest.raises(ConfigError) as info:
        load_config(config_path)
    assert any(e.startswith(words) for e in info.value.errors), info.value.errors
    assert not any(TOKEN in e for e in info.value.errors)
