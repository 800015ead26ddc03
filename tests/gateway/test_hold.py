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

# --- through two real gateway processes and Redis ----------------------------------


def test_the_bound_is_the_deployments_across_two_gateway_processes(gateway_web, make_replica, fake_engine, api_key):
    """hold_max 3 over two processes: exactly 3 held (a per-process bound would hold 6 of these 8), the other
    5 refused at once with 429 and Retry-After; the held ones served once a replica is ready."""
    import threading
    import time

    import httpx

    from gateway.load_report import HASH_KEY
    from gateway.load_report import store as load_store
    from tests.factories import CatalogEntryFactory

    from .conftest import wait_until

    client = load_store().client
    client.delete(hold.KEY.format("auto"), HASH_KEY)
    CatalogEntryFactory(name="auto", replicas=0, autoscale={"min": 0, "max": 1, "hold_max": 3, "hold_wait": 60})
    key = api_key()
    webs = [gateway_web(), gateway_web()]
    for web in webs:
        httpx.get(f"{web.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    # Each process has read the policies once it has published its load record.
    wait_until(lambda: len(load_store().records()) == 2, timeout=10, message="both processes' load records")

    answers: dict[int, httpx.Response] = {}

    def ask(index: int) -> None:
        body = {"model": "auto", "stream": index % 3 == 0, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(timeout=90, headers={"Authorization": f"Bearer {key}"}) as http:
            response = http.post(f"{webs[index % 2].url}/v1/chat/completions", json=body)
            answers[index] = response

    threads = []
    try:
        for index in range(8):  # in turn to one process then the other: A B A held, then B A B A B refused
            threads.append(threading.Thread(target=ask, args=(index,)))
            threads[-1].start()
            time.sleep(0.15)
        wait_until(lambda: len(answers) == 5, timeout=10, message="the requests past the bound refused")
        assert client.zcard(hold.KEY.format("auto")) == 3
        refused = sorted(answers)
        assert refused == [3, 4, 5, 6, 7], refused
        for index in refused:
            response = answers[index]
            assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1, response.text
            error = response.json()["error"]
            assert error["code"] == "model_starting" and "is starting" in error["message"]
            assert "3 request(s) already wait for it across the gateways" in error["message"]
        # A replica ready: the three held go to it; their places are given back.
        engine = fake_engine("auto")
        make_replica("auto", engine.port)
        for thread in threads:
            thread.join(timeout=30)
        assert [answers[i].status_code for i in range(3)] == [200, 200, 200], [answers[i].text for i in range(3)]
        assert "[DONE]" in answers[0].text
        assert len(engine.requests) == 3
        wait_until(lambda: client.zcard(hold.KEY.format("auto")) == 0, timeout=5, message="the places given back")
    finally:
        client.delete(hold.KEY.format("auto"))


def test_a_place_a_crashed_process_never_gave_back_expires(monkeypatch):
    from django.conf import settings

    monkeypatch.setattr(hold, "PLACE_MARGIN", 0.0)

    async def scenario():
        crashed, alive = hold.RedisPlaces(settings.LLMGW_REDIS_URL, "crashed"), hold.RedisPlaces(
            settings.LLMGW_REDIS_URL, "alive")
        await alive.client.delete(hold.KEY.format("leak"))
        try:
            assert await crashed.take("leak", 1, 0.4) is not None  # and never given back
            assert await alive.take("leak", 1, 0.4) is None
            await asyncio.sleep(0.6)
            return await alive.take("leak", 1, 0.4)
        finally:
            await alive.client.delete(hold.KEY.format("leak"))
            await crashed.close()
            await alive.close()

    assert asyncio.run(scenario()) is not None


def test_without_redis_answering_this_process_count_decides(asked):
    gw = _gateway({"qwen": (2, 30.0)})
    gw.holds.places = hold.RedisPlaces("redis://127.0.0.1:9/0", "test-process")  # nothing listens there

    async def scenario():
        held = [asyncio.ensure_future(gw.holds.hold(gw, "qwen")) for _ in range(2)]
        await asyncio.sleep(0.3)
        third = await gw.holds.hold(gw, "qwen")
        gw.table.by_model["qwen"] = ["a route"]
        return third, await asyncio.gather(*held)

    third, held = asyncio.run(scenario())
    assert held == [None, None]
    assert third.status_code == 429 and "2 request(s) already wait for it here" in json.loads(third.content)[
        "error"]["message"]
