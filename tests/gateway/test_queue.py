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

from gateway.queue import GatewayQueue, QueueSettings, Refusal, _ModelQueue, _Waiter, batch_limit
from gateway.routing import Route

from .conftest import wait_until


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


def test_room_counts_the_other_processes_from_the_last_exchange():
    from gateway.engineload import EngineReading
    from gateway.inflight import Shares

    gw, (route,) = _gw(10, 2)
    queue = _queue(10, headroom=0.2)  # batch share 8
    # The engine's reading would say the others have 6 there; the exchange (a sync old at most) says 5.
    route.engine = EngineReading(running=8, waiting=0, own_at_read=2, stale_at=time.monotonic() + 5)
    assert queue._room(gw, "m", 0) == 2
    queue.shares(Shares(ceilings={0: 4}, held={0: 5}))
    assert queue._room(gw, "m", 0) == 3  # interactive: 10 - 2 own - 5 the others use or hold
    assert queue._room(gw, "m", 2) == 2  # batch: up to this process's ceiling, 4
    route._inflight = 1  # one of its own ended: its slot stays its own, at once
    assert (queue._room(gw, "m", 0), queue._room(gw, "m", 2)) == (4, 3)
    queue.shares(Shares(ceilings={0: 1}, held={0: 7}))  # the others took theirs
    assert (queue._room(gw, "m", 0), queue._room(gw, "m", 2)) == (2, 0)


def test_without_a_fresh_exchange_the_engine_reading_counts_the_others():
    from gateway.engineload import EngineReading
    from gateway.inflight import Shares

    gw, (route,) = _gw(10, 2)
    queue = _queue(10)
    route.engine = EngineReading(running=8, waiting=0, own_at_read=2, stale_at=time.monotonic() + 5)
    queue.shares(Shares(ceilings={0: 10}, held={}))
    assert (queue._room(gw, "m", 0), queue._room(gw, "m", 2)) == (8, 8)
    queue.others_until = time.monotonic() - 0.1  # no exchange answered lately (Redis away)
    assert (queue._room(gw, "m", 0), queue._room(gw, "m", 2)) == (2, 2)  # 10 - 2 own - 6 the reading's others
    # A replica the last exchange did not cover (new in the table since) is counted from the reading too.
    queue.shares(Shares(ceilings={}, held={}))
    assert queue._room(gw, "m", 2) == 2


def test_an_engine_that_queues_takes_no_more_batch_but_still_interactive():
    from gateway.engineload import EngineReading

    gw, (route,) = _gw(10, 2)
    queue = _queue(10)  # LLMGW_GATEWAY_ENGINE_QUEUE 0
    route.engine = EngineReading(running=3, waiting=1, own_at_read=2, stale_at=time.monotonic() + 5)
    assert queue._room(gw, "m", 2) == 0  # batch: the engine's queue would only grow
    assert queue._room(gw, "m", 0) == 6 and queue._room(gw, "m", 1) == 6  # 10 - 2 own - 2 the others'
    route.engine = EngineReading(running=3, waiting=0, own_at_read=2, stale_at=time.monotonic() + 5)
    assert queue._room(gw, "m", 2) == 7


def test_wants_hold_batch_to_what_the_process_has_until_the_answer():
    from gateway.inflight import Shares

    gw, (route,) = _gw(10, 3)
    queue = _queue(10, headroom=0.2)
    queue.shares(Shares(ceilings={0: 6}, held={}))
    assert queue._room(gw, "m", 2) == 3
    queue.models["m"] = waiting = _ModelQueue()
    for key in (1, 1, 2):
        waiting.push(_Waiter(None, key, 2))
    waiting.granted = 1  # woken, not yet sent: counted as this process's
    assert queue.wants(gw.table, {0: 3}) == {0: (8, 4, 7)}  # share 8, 3 + 1 there, 3 batch waiters more
    assert queue._room(gw, "m", 2) == 0  # ceiling 4 until the exchange answers: the woken one fills it
    route._inflight = 2
    assert queue._room(gw, "m", 2) == 1  # its own freed slot stays its own


def test_a_batch_waiter_asks_for_an_exchange_only_when_one_would_let_it_in():
    """An idle process's last exchange gave it a batch ceiling of 0 (it wanted nothing): its first batch request
    asks the runtime to exchange now rather than wait for the next sync; one that waits because the share is
    used, or without ceilings in force, does not."""
    from gateway.inflight import Shares

    async def scenario():
        gw, (route,) = _gw(2, 0)
        queue = _queue(2, headroom=0.5)  # batch share 1
        asked = []
        queue.nudge = lambda: asked.append(route._inflight)
        queue.shares(Shares(ceilings={0: 0}, held={}))  # the exchange of an idle process
        first = asyncio.create_task(queue.enter(gw, "m", 1, "batch"))
        await asyncio.sleep(0)
        assert asked == [0] and not first.done()
        queue.shares(Shares(ceilings={0: 1}, held={}))  # the exchange it asked for: its share is its own
        queue.dispatch(gw, "m")
        assert await first is True
        route._inflight = 1  # the share in use: a second batch request waits for a slot, not for an exchange
        second = asyncio.create_task(queue.enter(gw, "m", 1, "batch"))
        await asyncio.sleep(0)
        assert asked == [0] and not second.done()
        second.cancel()
        route._inflight = 0
        queue.shares(Shares(ceilings={0: 0}, held={0: 1}))  # another process holds the share: no exchange helps
        third = asyncio.create_task(queue.enter(gw, "m", 1, "batch"))
        await asyncio.sleep(0)
        assert asked == [0]
        third.cancel()
        await asyncio.sleep(0)  # (it leaves the queue)
        queue.shares(Shares(ceilings={0: 0}, held={}))
        queue.others_until = time.monotonic() - 1  # no exchange answered lately: the readings count, no ceiling
        assert await queue.enter(gw, "m", 1, "batch") is False and asked == [0]

    asyncio.run(scenario())


def test_an_idle_gateways_first_batch_request_does_not_wait_for_the_next_sync(gateway_web, make_replica,
                                                                                sim_engine, api_key):
    """Through a real gateway on Redis with a sync every 3 s: once its first exchange (idle: batch ceiling 0) is
    written, a batch request is answered at once, not when the next sync comes or that exchange's answer goes
    stale (gateway.queue.OTHERS_FOR, 1 s)."""
    import redis
    from django.conf import settings

    from gateway.inflight import HASH_KEY
    from gateway.services import key_update

    make_replica("m", sim_engine("m"))
    key = api_key("batch-team")
    key_update(name="batch-team", priority="batch")
    web = gateway_web(LLMGW_GATEWAY_SYNC_INTERVAL="3")
    store = redis.Redis.from_url(settings.LLMGW_REDIS_URL)
    try:
        wait_until(lambda: store.hlen(HASH_KEY) > 0, timeout=10, message="the gateway's first exchange")
    finally:
        store.close()
    started = time.monotonic()
    answer = httpx.post(f"{web.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=10,
                        json={"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2})
    took = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    assert took < 0.5, f"the batch request took {took:.2f} s: it waited for a sync"


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
    """Each process counts the other's requests (from its record, read back on each sync) toward the batch
    limit."""
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


@pytest.fixture
def exchange_store():
    """gateway.inflight.RedisInflight on a hash of its own in the tests' Redis."""
    import uuid

    from django.conf import settings

    from gateway.inflight import RedisInflight

    store = RedisInflight(settings.LLMGW_REDIS_URL, key=f"llmgw:test:processes:{uuid.uuid4().hex}")
    yield store
    store.client.delete(store.key)
    store.client.close()


def test_the_exchange_never_lets_the_processes_hold_more_than_the_batch_share(exchange_store):
    """Three processes exchange in a random order, each admitting up to its ceiling and ending requests at random
    between: the batch requests on the replica never add up past its share, and a process that waits alone gets
    every free slot."""
    import random

    rng = random.Random(24)
    share, names = 12, ["a", "b", "c"]
    own = dict.fromkeys(names, 0)
    waiting = dict.fromkeys(names, 0)
    most = 0
    for _ in range(600):
        name = rng.choice(names)
        waiting[name] = max(0, waiting[name] + rng.choice((-3, 0, 2, 5)))
        answer = exchange_store.exchange(name=name, routes=[7], inflight={7: own[name]} if own[name] else {},
                                         wants={7: (share, own[name], own[name] + waiting[name])})
        taken = max(0, min(waiting[name], answer.ceilings[7] - own[name]))
        own[name] += taken
        waiting[name] -= taken
        for other in names:
            own[other] -= rng.randint(0, own[other] // 2)
        assert sum(own.values()) <= share, own
        most = max(most, sum(own.values()))
    assert most == share  # the share was used, not only kept

    for name in names:  # only "a" wants more: it gets every slot the others do not use
        own[name] = 0
        exchange_store.exchange(name=name, routes=[7], inflight={}, wants={7: (share, 0, 0)})
    assert exchange_store.exchange(name="a", routes=[7], inflight={}, wants={7: (share, 0, 20)}).ceilings == {7: 12}


def test_the_exchange_shares_evenly_while_others_want_more_and_forgets_the_gone(exchange_store):
    share = 12
    first = exchange_store.exchange(name="a", routes=[7], inflight={}, wants={7: (share, 0, 30)})
    assert first.ceilings == {7: 12} and first.held == {}
    # "b" wants as much: "a" holds all of it, so "b" gets nothing now, and "a" is told to come down to 6.
    assert exchange_store.exchange(name="b", routes=[7], inflight={}, wants={7: (share, 0, 30)}).ceilings == {7: 0}
    down = exchange_store.exchange(name="a", routes=[7], inflight={7: 12}, wants={7: (share, 12, 30)})
    assert down.ceilings == {7: 6} and down.held == {}  # "b" holds nothing yet
    # "a"'s requests end below it; "b" takes the rest.
    exchange_store.exchange(name="a", routes=[7], inflight={7: 5}, wants={7: (share, 5, 30)})
    assert exchange_store.exchange(name="b", routes=[7], inflight={}, wants={7: (share, 0, 30)}).ceilings == {7: 6}
    # A process whose record is older than inflight.STALE_AFTER is gone: what it held is free.
    import json

    record = json.loads(exchange_store.client.hget(exchange_store.key, "b"))
    record["at"] -= 60
    exchange_store.client.hset(exchange_store.key, "b", json.dumps(record))
    alone = exchange_store.exchange(name="a", routes=[7], inflight={7: 6}, wants={7: (share, 6, 30)})
    assert alone.ceilings == {7: 12}
    # Interactive requests count toward a process's requests but a slot one leaves is not batch's to take.
    over = exchange_store.exchange(name="a", routes=[7], inflight={7: 14}, wants={7: (share, 14, 20)})
    assert over.ceilings == {7: 12}
