"""Held requests (gateway/hold.py): released in arrival order when a replica
is ready; past the count bound a 429, past the wait a 503, both with
Retry-After and the model_starting code; holding asks the autoscaler at once."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from gateway import hold
from gateway.load_report import LoadReport


def _gateway(policies):
    holds = hold.Holds()
    holds.policies = policies
    gw = SimpleNamespace(name="test-process", table=SimpleNamespace(by_model={}, routes={}), holds=holds,
                         queue=SimpleNamespace(waiting=dict), load=LoadReport(), _db=ThreadPoolExecutor(max_workers=1))
    return gw


@pytest.fixture
def asked(monkeypatch):
    calls = []
    monkeypatch.setattr(hold, "autoscale_wake_request", lambda *, model: calls.append(model))
    monkeypatch.setattr(LoadReport, "publish", lambda self, name, models: calls.append(("published", models)))
    return calls


def test_released_in_arrival_order_when_a_replica_is_ready(asked):
    gw = _gateway({"qwen": (10, 30.0)})
    order = []

    async def one(i):
        answer = await gw.holds.hold(gw, "qwen")
        order.append((i, answer))

    async def scenario():
        tasks = []
        for i in range(5):
            tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert gw.holds.counts() == {"qwen": 5}
        gw.table.by_model["qwen"] = ["a route"]
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert order == [(i, None) for i in range(5)]
    assert gw.holds.counts() == {}
    # Its counts published first (with the held request), then the autoscaler asked, once.
    assert asked[0] == ("published", {"qwen": [0, 1, None]}) and asked[1:] == ["qwen"]


def test_past_the_count_429_past_the_wait_503(asked):
    gw = _gateway({"qwen": (2, 0.3)})

    async def scenario():
        first = [asyncio.ensure_future(gw.holds.hold(gw, "qwen")) for _ in range(2)]
        await asyncio.sleep(0.05)
        third = await gw.holds.hold(gw, "qwen")
        return third, await asyncio.gather(*first)

    third, timed_out = asyncio.run(scenario())
    assert third.status_code == 429 and int(third["Retry-After"]) >= 1
    error = json.loads(third.content)["error"]
    assert error["code"] == "model_starting" and "is starting" in error["message"]
    assert "2 request(s) already wait for it here" in error["message"]
    for answer in timed_out:
        assert answer.status_code == 503 and answer["Retry-After"] == "1"
        assert "no replica was ready within 0.3s" in json.loads(answer.content)["error"]["message"]


def test_a_client_that_goes_away_leaves_the_queue(asked):
    gw = _gateway({"qwen": (1, 30.0)})

    async def scenario():
        task = asyncio.ensure_future(gw.holds.hold(gw, "qwen"))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.01)
        # Its place is free again.
        again = asyncio.ensure_future(gw.holds.hold(gw, "qwen"))
        await asyncio.sleep(0.05)
        assert gw.holds.counts() == {"qwen": 1}
        gw.table.by_model["qwen"] = ["a route"]
        return await again

    assert asyncio.run(scenario()) is None


def test_let_go_in_the_turn_its_wait_runs_out_it_goes(asked):
    gw = _gateway({"qwen": (10, 0.05)})

    async def scenario():
        held = asyncio.ensure_future(gw.holds.hold(gw, "qwen"))
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        door = gw.holds._doors["qwen"]
        door.cancel()  # the test lets it go itself, in the turn the wait runs out
        loop.call_later(0.001, time.sleep, 0.1)
        loop.call_later(0.002, lambda: gw.holds.queues["qwen"][0].set_result(True))
        return await held, gw.holds.counts()

    # A replica was ready for it: it goes, rather than a 503 saying none was.
    assert asyncio.run(scenario()) == (None, {})
