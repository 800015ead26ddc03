"""The cache-aware prefix memory shared between gateway processes through
the real Redis (gateway.prefixshare): what one table sends, another routes
on after one write and one read; each replica's set stays bounded."""

from __future__ import annotations

import os
import uuid

import pytest
import redis

from gateway.prefixshare import PrefixShare, key
from gateway.routing import CACHE_AWARE, Hints, RoutingTable
from gateway.selectors import RouteRow, RoutingSnapshot


@pytest.fixture
def client():
    url = os.environ.get("LLMGW_REDIS_URL")
    if not url:
        pytest.skip("needs LLMGW_REDIS_URL")
    connection = redis.Redis.from_url(url)
    yield connection
    for name in connection.scan_iter("llmgw:gateway:prefix:share-test-*"):
        connection.delete(name)
    connection.close()


def _table(model: str, client, cache_tokens: int = 1000) -> RoutingTable:
    table = RoutingTable(chars_per_token=1, block_chars=1, cache_tokens=cache_tokens)
    table.apply(RoutingSnapshot(catalog={model: 0}, keys=[], policies={model: CACHE_AWARE},
                                routes=[RouteRow(r, model, f"http://127.0.0.1:{9000 + r}") for r in (1, 2, 3)]))
    table.share = PrefixShare(client)
    return table


def _sync(table: RoutingTable) -> None:
    table.share.flush()
    table.apply_shared(table.share.read(table.shared_wanted()))


def test_a_prefix_placed_by_one_process_is_routed_to_the_same_replica_by_another(client):
    model = f"share-test-{uuid.uuid4().hex[:8]}"
    a, b = _table(model, client), _table(model, client)
    prefixes = [Hints(blocks=tuple(range(n * 100, n * 100 + 30)), chars=40) for n in range(3)]
    placed = []
    for hints in prefixes:  # a spreads them: each in flight while the next is placed
        route = a.pick(model, hints=hints)
        route.inflight += 1
        placed.append(route.replica_id)
    assert len(set(placed)) == 3
    # A process that has not read the others' placements finds the prefixes nowhere.
    alone = _table(model, client)
    for hints in prefixes:
        alone.pick(model, hints=hints)
    assert alone.decisions == {(model, "load"): 3}
    _sync(a)
    _sync(b)
    assert [b.pick(model, hints=h).replica_id for h in prefixes] == placed
    assert b.decisions[(model, "prefix")] == 3
    # The order survives the trip: b holds each prompt's blocks, its first the most recent.
    held = b.memories[model].held[placed[0]]
    assert list(held)[-1] == prefixes[0].blocks[0]


def test_each_replicas_set_is_bounded_by_its_cache_and_reads_are_incremental(client):
    model = f"share-test-{uuid.uuid4().hex[:8]}"
    a = _table(model, client, cache_tokens=50)  # 50 blocks of memory per replica
    b = _table(model, client, cache_tokens=50)
    for n in range(10):
        route = a.pick(model, hints=Hints(blocks=tuple(range(n * 1000, n * 1000 + 20)), chars=20))
        route.inflight += 1  # round the three: 4, 3 and 3 prompts of 20 blocks
    assert a.share.flush() == 200
    for replica in (1, 2, 3):
        assert client.zcard(key(model, replica)) == 50  # 60-80 blocks sent, the newest 50 kept
        assert 0 < client.ttl(key(model, replica)) <= 600
    first = b.share.read(b.shared_wanted())
    assert sum(len(blocks) for _, _, blocks in first) == sum(client.zcard(key(model, r)) for r in (1, 2, 3))
    b.share.last_score = {k: v + 10**12 for k, v in b.share.last_score.items()}  # past the overlap
    assert b.share.read(b.shared_wanted()) == []  # nothing new
    assert a.share.flush() == 0  # nothing noted since
