"""The in-memory parts, without processes: the balancing choice and usage parsing."""

from __future__ import annotations

import collections

from gateway.proxy import _take_usage, usage_of
from gateway.routing import RoutingTable
from gateway.selectors import RouteRow, RoutingSnapshot


def _table(*replicas: int) -> RoutingTable:
    table = RoutingTable()
    table.apply(RoutingSnapshot(catalog={"m": 0}, keys=[],
                                routes=[RouteRow(r, "m", f"http://127.0.0.1:{9000 + r}") for r in replicas]))
    return table


def test_pick_prefers_fewest_outstanding_and_spreads_ties():
    table = _table(1, 2, 3)
    table.routes[1].inflight = 2
    table.routes[2].inflight = 1
    table.routes[3].inflight = 1
    picks = collections.Counter(table.pick("m").replica_id for _ in range(200))
    assert set(picks) == {2, 3}


def test_pick_passes_over_a_replica_that_refused_while_another_is_there():
    table = _table(1, 2)
    table.mark_down(table.routes[1])
    table.routes[2].inflight = 10
    assert {table.pick("m").replica_id for _ in range(20)} == {2}
    assert table.pick("m", exclude=table.routes[2]).replica_id == 1
    solo = _table(7)
    assert solo.pick("m", exclude=solo.routes[7]) is None


def test_reload_keeps_counts_and_departed_routes_with_requests():
    table = _table(1, 2)
    route = table.routes[1]
    route.inflight = 3
    table.apply(RoutingSnapshot(catalog={"m": 0}, keys=[], routes=[RouteRow(2, "m", "http://127.0.0.1:9002")]))
    assert table.routed_ids() == [2]
    assert table.inflight_counts() == {1: 3}  # still visible to a drain
    route.inflight = 0
    table.apply(RoutingSnapshot(catalog={"m": 0}, keys=[], routes=[RouteRow(2, "m", "http://127.0.0.1:9002")]))
    assert 1 not in table.routes


def test_usage_parsing_and_stripping():
    body = b'{"id": "x", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46}}'
    assert usage_of(body) == (12, 34)
    assert usage_of(b'{"usage": null}') == (0, 0)
    content = b'data: {"choices": [{"delta": {"content": "hi"}}], "usage": null}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
    done = b"data: [DONE]\n\n"
    assert _take_usage(content + usage + done, strip=True) == (content + done, (1, 2))
    assert _take_usage(usage, strip=True) == (b"", (1, 2))
    assert _take_usage(usage + done, strip=False) == (usage + done, (1, 2))
