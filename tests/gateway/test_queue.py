"""The gateway's queue (gateway/queue.py): a model whose every replica is at
capacity makes requests wait, in order of priority class, round-robin between
keys within a class, then arrival; bounded in count (429) and wait (503);
batch keys leave headroom; a client that goes away leaves the queue. Then the
same through a real gateway and sim engine."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from gateway.queue import GatewayQueue, QueueSettings, Refusal, batch_limit
from gateway.routing import Route


def _gw(capacity: int, inflight: int, replicas: int = 1):
    routes = [Route(i, "m", f"http://127.0.0.1:{9000 + i}") for i in range(replicas)]
    for route in routes:
        route._inflight = inflight
    return SimpleNamespace(table=SimpleNamespace(by_model={"m": routes})), routes


def _queue(capacity: int, *, most: int = 100, wait: float = 5.0, headroom: float = 0.0) -> GatewayQueue:
    queue = GatewayQueue(QueueSettings(most=most, wait=wait, engine_queue=0, batch_headroom=headroom))
    queue.capacity = {"m": capacity}
    return queue


def test_batch_limit_from_the_catalog_args():
    assert batch_limit(["--max-num-seqs", "8"]) == 8
    assert batch_limit(["--max-num-seqs=12", "--foo"]) == 12
    assert batch_limit(["--max-running-requests", "3"]) == 3
    assert batch_limit(["--max-num-seqs"]) == 256 and batch_limit(None) == 256


def test_order_is_priority_then_round_robin_between_keys_then_arrival():
    async def scenario():
        gw, (route,) = _gw(2, 2)
        queue = _queue(2)
        served: list[str] = []

        async def request(name: str, key: int, priority: str):
            waited = await queue.enter(gw, "m", key, priority)
            assert waited
            route._inflight += 1
            served.append(name)

        arrivals = [("b1-1", 1, "batch"), ("b1-2", 1, "batch"), ("b1-3", 1, "batch"), ("s2", 2, "standard"),
                    ("b4-1", 4, "batch"), ("i3", 3, "interactive")]
        tasks = []
        for name, key, priority in arrivals:
            tasks.append(asyncio.create_task(request(name, key, priority)))
            await asyncio.sleep(0.001)
        assert queue.waiting() == {"m": 6} and served == []
        for _ in arrivals:  # one slot comes free at a time
            route._inflight -= 1
            queue.dispatch(gw, "m")
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
        return served

    assert asyncio.run(scenario()) == ["i3", "s2", "b1-1", "b4-1", "b1-2", "b1-3"]


def test_room_means_no_wait_and_batch_leaves_headroom():
    async def scenario():
        gw, (route,) = _gw(10, 8)
        queue = _queue(10, headroom=0.2)  # batch fills 8 of 10
        assert await queue.enter(gw, "m", 1, "interactive") is False
        batch = asyncio.create_task(queue.enter(gw, "m", 2, "batch"))
        await asyncio.sleep(0.01)
        assert not batch.done()
        assert await asyncio.wait_for(queue.enter(gw, "m", 3, "standard"), 1) is False  # no one of its class waits
        route._inflight = 7
        queue.dispatch(gw, "m")
        assert await asyncio.wait_for(batch, 1) is True

    asyncio.run(scenario())


def test_room_counts_the_other_gateways_share_of_a_fresh_reading():
    from gateway.engineload import EngineReading

    gw, (route,) = _gw(4, 1)
    queue = _queue(4)
    assert queue._room(gw, "m", 1) == 3  # no reading: this process's own count alone
    # The engine ran 3 when this process had 1 there: 2 are other gateways'; this process's own is now 1.
    route.engine = EngineReading(running=3, waiting=0, own_at_read=1, stale_at=time.monotonic() + 5)
    assert queue._room(gw, "m", 1) == 1
    route._inflight = 0  # one of its own ended since: exact at once, without waiting for the next reading
    assert queue._room(gw, "m", 1) == 2
    # This process's own requests the engine had not counted yet are not taken for the others' (never below 0).
    route.engine = EngineReading(running=0, waiting=0, own_at_read=3, stale_at=time.monotonic() + 5)
    assert queue._room(gw, "m", 1) == 4
    route.engine = EngineReading(running=4, waiting=0, own_at_read=0, stale_at=time.monotonic() + 5)
    assert queue._room(gw, "m", 1) == 0
    route.engine.stale_at = time.monotonic() - 1  # a stale reading counts for nothing
    assert queue._room(gw, "m", 1) == 4


def test_bounds_count_then_wait():
    async def scenario():
        gw, _ = _gw(1, 1)
        queue = _queue(1, most=2, wait=0.3)
        first = asyncio.create_task(queue.enter(gw, "m", 1, "standard"))
        second = asyncio.create_task(queue.enter(gw, "m", 2, "standard"))
        await asyncio.sleep(0.01)
        with pytest.raises(Refusal) as full:
            await queue.enter(gw, "m", 3, "standard")
        started = time.monotonic()
        with pytest.raises(Refusal) as waited:
            await first
        with pytest.raises(Refusal):
            await second
        return full.value, waited.value, time.monotonic() - started, queue.waiting()

    full, waited, took, left = asyncio.run(scenario())
    assert (full.status, full.kind, full.retry_after) == (429, "queue_full", 1)
    assert "2 request(s) already wait" in full.message
    assert (waited.status, waited.kind) == (503, "queue_full") and "for 0.3s" in waited.message
    assert took < 1 and left == {}


def test_a_full_queue_gives_a_batch_place_to_an_interactive_request():
    async def scenario():
        gw, (route,) = _gw(1, 1)
        queue = _queue(1, most=2)
        old = asyncio.create_task(queue.enter(gw, "m", 1, "batch"))
        new = asyncio.create_task(queue.enter(gw, "m", 1, "batch"))
        await asyncio.sleep(0.01)
        chat = asyncio.create_task(queue.enter(gw, "m", 2, "interactive"))
        await asyncio.sleep(0.01)
        with pytest.raises(Refusal) as evicted:
            await new
        route._inflight = 0
        queue.dispatch(gw, "m")
        assert await asyncio.wait_for(chat, 1) is True
        assert not old.done()
        old.cancel()
        return evicted.value

    assert asyncio.run(scenario()).status == 429


def test_a_client_that_goes_away_leaves_the_queue():
    async def scenario():
        gw, (route,) = _gw(1, 1)
        queue = _queue(1)
        gone = asyncio.create_task(queue.enter(gw, "m", 1, "interactive"))
        stays = asyncio.create_task(queue.enter(gw, "m", 2, "batch"))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        assert queue.waiting() == {"m": 1}
        route._inflight = 0
        queue.dispatch(gw, "m")
        return await asyncio.wait_for(stays, 1)

    assert asyncio.run(scenario()) is True


def test_through_the_gateway_interactive_passes_a_batch_flood(gateway_web, make_replica, sim_engine, api_key):
    from gateway.services import key_update
    from replicas.models import CatalogEntry

    make_replica("m", sim_engine("m", token_delay=0.05))
    CatalogEntry.objects.filter(name="m").update(args=["--max-num-seqs", "2"])
    batch, interactive = api_key("batch-team"), api_key("chat-team")
    key_update(name="batch-team", priority="batch")
    key_update(name="chat-team", priority="interactive")
    # Capacity 2 a replica; batch fills 1 of them (headroom 0.5); 2 batch requests may wait, then 429.
    web = gateway_web(LLMGW_GATEWAY_QUEUE_MAX="2", LLMGW_GATEWAY_BATCH_HEADROOM="0.5")
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 20}

    async def scenario():
        async with httpx.AsyncClient(base_url=web.url, timeout=30) as client:
            async def post(key):
                started = time.monotonic()
                answer = await client.post("/v1/chat/completions", json=body,
                                           headers={"Authorization": f"Bearer {key}"})
                return answer, time.monotonic() - started

            flood = []
            for _ in range(4):
                flood.append(asyncio.create_task(post(batch)))
                await asyncio.sleep(0.05)
            chat = await post(interactive)
            return chat, await asyncio.gather(*flood)

    (chat, chat_took), flood = asyncio.run(scenario())
    assert chat.status_code == 200 and chat_took < 2.0  # one generation's time: it waited for no batch request
    codes = sorted(a.status_code for a, _ in flood)
    assert codes == [200, 200, 200, 429], codes
    refused = next(a for a, _ in flood if a.status_code == 429)
    assert refused.json()["error"]["code"] == "queue_full" and int(refused.headers["retry-after"]) >= 1
    # The three batch requests ran one at a time: the last finished after about three generations.
    assert max(t for a, t in flood if a.status_code == 200) > 2.5


def _same_turn(loop, wait: float, free) -> None:
    """Block the loop past a waiter's deadline, then run ``free`` first in the turn its timeout fires: the waiter
    is woken and timed out at once (the race a busy gateway meets)."""
    loop.call_later(0.001, time.sleep, wait * 2)
    loop.call_later(0.002, free)


def test_woken_in_the_turn_its_wait_runs_out_it_goes_and_nothing_stays_spoken_for():
    async def scenario():
        gw, (route,) = _gw(1, 1)
        queue = _queue(1, wait=0.05)
        waiting = asyncio.create_task(queue.enter(gw, "m", 1, "standard"))
        await asyncio.sleep(0)

        def free():
            route._inflight = 0
            queue.dispatch(gw, "m")

        _same_turn(asyncio.get_running_loop(), 0.05, free)
        went = await waiting
        return went, queue.models["m"].granted

    # Before: a 503 for a request that had its slot, and the slot spoken for for ever (one less each time).
    assert asyncio.run(scenario()) == (True, 0)


def test_an_evicted_waiter_whose_client_left_in_the_same_turn():
    async def scenario():
        gw, (route,) = _gw(1, 1)
        queue = _queue(1, most=1)
        batch = asyncio.create_task(queue.enter(gw, "m", 1, "batch"))
        await asyncio.sleep(0.01)

        def free():
            route._inflight = 0
            queue.dispatch(gw, "m")

        asyncio.get_running_loop().call_later(0.05, free)
        batch.cancel()  # its future is cancelled now; its own clean-up runs on its next step
        # In this same turn, a request of a higher class takes the full queue's place: the batch one's.
        went = await queue.enter(gw, "m", 2, "interactive")
        with pytest.raises(asyncio.CancelledError):
            await batch
        return went, queue.models["m"].granted, queue.waiting()

    # Before: InvalidStateError (a 500) for the interactive request.
    assert asyncio.run(scenario()) == (True, 0, {})


def test_two_gateway_processes_do_not_overfill_an_engine(gateway_web, make_replica, sim_engine):
    """Each process counts the other's requests (the engine's reading less its own) toward the batch limit."""
    import re

    from gateway.load_report import deployment_load
    from replicas.models import CatalogEntry

    port = sim_engine("m", token_delay=0.05)
    make_replica("m", port)
    CatalogEntry.objects.filter(name="m").update(args=["--max-num-seqs", "2"])
    env = {"LLMGW_GATEWAY_OPEN": "1", "LLMGW_GATEWAY_ENGINE_QUEUE": "0",
           "LLMGW_GATEWAY_ENGINE_SCRAPE_INTERVAL": "0.2"}
    first, second = gateway_web(**env), gateway_web(**env)
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 40}  # ~2 s each

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            async def running() -> int:
                page = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
                return int(float(re.search(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)", page, re.M).group(1)))

            fills = [asyncio.create_task(client.post(f"{first.url}/v1/chat/completions", json=body))
                     for _ in range(2)]
            while await running() < 2:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.6)  # the second process has read the engine since
            late = asyncio.create_task(client.post(f"{second.url}/v1/chat/completions", json=body))
            most, queued = 0, 0
            while not late.done():
                most = max(most, await running())
                queued = max(queued, deployment_load().get("m", (0, 0, None))[1])
                await asyncio.sleep(0.05)
            return most, queued, [a.status_code for a in await asyncio.gather(*fills)], (await late).status_code

    most, queued, fills, late = asyncio.run(scenario())
    assert fills == [200, 200] and late == 200
    assert queued == 1  # the second process queued its request ...
    assert most <= 2  # ... and the engine never ran more than its batch limit
