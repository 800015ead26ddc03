"""Fixtures of the gateway tests: real engines (the sim engine, or a fake
upstream a test controls) registered as ready replicas, and the real web
process in front of them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.utils import timezone

from cli.wait import wait_until  # noqa: F401 - the gateway tests import it from here
from tests.conftest import REPO, free_port, wait_for_port
from tests.factories import CatalogEntryFactory, NodeFactory

from .upstream import FakeEngine


@pytest.fixture
def gw_node(transactional_db):
    return NodeFactory(name="gw-node", mgmt_addr="127.0.0.1")


@pytest.fixture
def make_replica(gw_node):
    """make_replica(model name, port, status="ready") -> Replica whose leader serves 127.0.0.1:port."""
    from replicas.models import Member, Replica

    def make(model: str, port: int, status: str = "ready"):
        catalog_entry = CatalogEntryFactory(name=model)
        replica = Replica.objects.create(model=catalog_entry, status=status, status_changed_at=timezone.now())
        Member.objects.create(replica=replica, node=gw_node, rank=0, ports={"http": port, "rendezvous": free_port()},
                              serves_http=True, state="running", healthy=True)
        return replica

    return make


@pytest.fixture
def sim_engine(tmp_path):
    """sim_engine(model, token_delay=0.0) -> port of a real sim engine leader on 127.0.0.1."""
    procs: list[subprocess.Popen] = []

    def start(model: str, token_delay: float = 0.0) -> int:
        port = free_port()
        log = open(tmp_path / f"sim-{port}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent.engines.sim", "--rank", "0", "--nnodes", "1", "--host", "127.0.0.1",
             "--port", str(port), "--model", model, "--token-delay", str(token_delay)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        procs.append(proc)
        wait_for_port("127.0.0.1", port, proc=proc)
        return port

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


@pytest.fixture
def fake_engine():
    engines: list[FakeEngine] = []

    def start(model: str, **kwargs) -> FakeEngine:
        engine = FakeEngine(model, **kwargs).start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        engine.stop()


@pytest.fixture
def gateway_web(web_factory):
    """gateway_web(http=None, **env) -> the real web process (uvicorn; web_factory's http), syncing its routing
    table every 0.1 s."""

    def start(**env: str):
        env.setdefault("LLMGW_GATEWAY_SYNC_INTERVAL", "0.1")
        return web_factory(**env)

    return start


@pytest.fixture
def api_key(transactional_db):
    """api_key(name, models=None) -> the key itself."""
    from gateway.services import key_create

    def create(name: str = "tests", models: list[str] | None = None) -> str:
        return key_create(name=name, models=models).key

    return create


def metric_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """/metrics read with prometheus_client's own parser: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]
