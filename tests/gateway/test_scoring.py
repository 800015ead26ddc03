"""The routing policies as pure functions (gateway.scoring, gateway.prefix), with randomised inputs."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from gateway import scoring
from gateway.engineload import parse
from gateway.prefix import PrefixMemory, prompt_blocks, prompt_text, session_hash
from gateway.routing import CACHE_AWARE, SESSION, Hints, RoutingTable
from gateway.scoring import Candidate, Knobs, overloaded
from gateway.selectors import RouteRow, RoutingSnapshot

KNOBS = Knobs()

candidate = st.builds(
    Candidate,
    replica_id=st.integers(1, 10_000),
    inflight=st.integers(0, 200),
    running=st.none() | st.integers(0, 256),
    waiting=st.none() | st.integers(0, 500),
    kv_use=st.none() | st.floats(0, 1),
    matched=st.integers(0, 128),
    down=st.booleans(),
    backlog=st.none() | st.integers(0, 100_000),
    uncached=st.floats(0, 20_000),
    cache_tokens=st.integers(0, 400_000),
)
candidates = st.lists(candidate, min_size=1, max_size=24, unique_by=lambda c: c.replica_id)


@settings(max_examples=400)
@given(candidates, st.integers(1, 128))
def test_cache_aware_never_picks_an_overloaded_replica_while_one_is_under_the_guard(cands, blocks):
    for c in cands:
        c.matched = min(c.matched, blocks)
    index, reason = scoring.cache_aware(cands, blocks, KNOBS)
    up = [c for c in cands if not c.down] or cands
    least = min(c.load for c in up)
    chosen = cands[index]
    assert chosen in up
    assert not overloaded(chosen.load, least, KNOBS)
    assert reason in {"prefix", "load", "guard"}
    if reason == "prefix":
        assert chosen.matched == max(c.matched for c in up) > 0


@given(candidates, st.integers(1, 128))
def test_cache_aware_without_any_prefix_is_least_loaded(cands, blocks):
    for c in cands:
        c.matched = 0
    index, reason = scoring.cache_aware(cands, blocks, KNOBS)
    up = [c for c in cands if not c.down] or cands
    assert reason == "load" and cands[index].load == min(c.load for c in up)


def test_with_backlogs_known_the_cheapest_prefill_wins_dynamo_style():
    """The holder saves 4,000 tokens of prefill: it wins while its backlog is
    less than 4,000 tokens above the others', and loses past that."""
    def cands(holder_backlog: int) -> list[Candidate]:
        return [Candidate(1, inflight=2, matched=40, backlog=holder_backlog, uncached=400, cache_tokens=24_000),
                Candidate(2, inflight=0, backlog=0, uncached=4_400, cache_tokens=24_000),
                Candidate(3, inflight=1, backlog=500, uncached=4_400, cache_tokens=24_000)]
    assert scoring.cache_aware(cands(3_000), 44) == (0, "prefix")
    index, reason = scoring.cache_aware(cands(5_000), 44)
    assert (cands(5_000)[index].replica_id, reason) == (2, "load")
    # KV tokens held count at decode_weight: 0.1 x 0.5 x 24,000 = 1,200 tokens of cost.
    busy = cands(3_000)
    busy[0].kv_use = 0.5
    assert scoring.cache_aware(busy, 44) == (1, "load")
    # One candidate's engine without a backlog: llm-d's weighted sum decides (the prefix).
    unknown = cands(5_000)
    unknown[2].backlog = None
    assert scoring.cache_aware(unknown, 44) == (0, "prefix")
    # prefill_weight 0: never the cost.
    assert scoring.cache_aware(cands(5_000), 44, Knobs(prefill_weight=0)) == (0, "prefix")


def test_table_counts_what_it_sent_since_the_reading_in_the_backlog():
    from gateway.engineload import EngineReading

    table = _table(CACHE_AWARE, 1, 2)
    for route in table.routes.values():
        route.engine = EngineReading(running=0, waiting=0, kv_use=0.0, backlog=0, stale_at=float("inf"))
    hot = Hints(blocks=tuple(range(20)), chars=10_000)  # 1 char a block and a token: 20 tokens saved on a hit
    sent = [table.pick("m", hints=hot).replica_id for _ in range(3)]
    # Held nowhere: either (at random); then the holder's 10,000 tokens sent since
    # the reading outweigh the 20 its cache saves; then both hold it, equally busy.
    assert sent[0] != sent[1] and sent[2] == 1
    assert sorted([table.routes[1].sent_tokens, table.routes[2].sent_tokens]) == [10_000, 10_000 + 9_980]
    assert table.decisions == {("m", "load"): 2, ("m", "prefix"): 1}


def test_an_answered_request_no_longer_counts_in_its_replicas_backlog():
    """Until the engine's next reading, a replica's backlog counts what this process sent there since the
    last one and has not had answered. A prompt the holder has answered (gateway.proxy counts it prefilled)
    no longer weighs against the holder: the same prefix goes back to its cache. (Counted until the next
    reading, it made the holder cost what a whole prefill elsewhere costs, and a tie sent it elsewhere.)"""
    from gateway.engineload import EngineReading

    prefix = tuple(range(10_000))
    second = Hints(blocks=prefix + tuple(range(10_000, 10_100)), chars=10_100)

    def second_goes_to(answered: bool, read_between: bool = False) -> int:
        table = _table(CACHE_AWARE, 1, 2)
        for route in table.routes.values():
            route.engine = EngineReading(running=0, waiting=0, kv_use=0.0, backlog=0, stale_at=float("inf"))
        table.routes[1].inflight = 1  # busy for a moment: the first prompt goes to 2
        home = table.pick("m", hints=Hints(blocks=prefix, chars=10_000))
        table.routes[1].inflight = 0
        assert home.replica_id == 2 and table.last_sent == 10_000
        if read_between:  # the engine read while the prompt waited for prefill there
            home.engine = EngineReading(running=1, waiting=0, kv_use=0.0, backlog=10_000, stale_at=float("inf"),
                                        own_at_read=1, sent_at_read=home.sent_tokens)
        if answered:
            home.prefilled_tokens += table.last_sent
        return table.pick("m", hints=second).replica_id

    assert second_goes_to(answered=True) == 2
    assert second_goes_to(answered=True, read_between=True) == 2
    # Not answered: its 10,000 tokens still wait for prefill there, as much as the other's whole prompt would.
    assert second_goes_to(answered=False) == 1


def test_hot_prefix_goes_elsewhere_once_its_holder_is_overloaded():
    cands = [Candidate(1, inflight=3, matched=10), Candidate(2, inflight=0), Candidate(3, inflight=1)]
    assert scoring.cache_aware(cands, 10) == (0, "prefix")
    cands[0].inflight = 20  # more than balance_abs above the least, and 1.5x
    index, reason = scoring.cache_aware(cands, 10)
    assert (cands[index].replica_id, reason) == (2, "guard")


@settings(max_examples=300)
@given(candidates, st.text(min_size=1, max_size=30))
def test_session_never_lands_on_an_overloaded_replica_while_another_fits(cands, key):
    for c in cands:
        c.down = False
    index, reason = scoring.session(cands, session_hash(key), KNOBS)
    least = min(c.load for c in cands)
    assert not overloaded(cands[index].load, least, KNOBS)
    assert reason in {"session", "rehome"}


@settings(max_examples=300)
@given(st.lists(st.integers(1, 500), min_size=2, max_size=20, unique=True), st.text(min_size=1, max_size=20),
       st.data())
def test_session_stays_while_its_replica_stays_and_moves_only_from_a_leaver(ids, key, data):
    """Any replica other than the session's joining or leaving leaves it where it is;
    its own replica leaving moves it (and only then)."""
    session = session_hash(key)
    idle = [Candidate(i) for i in ids]
    home = idle[scoring.session(idle, session)[0]].replica_id
    other = data.draw(st.sampled_from([i for i in ids if i != home]))
    without_other = [Candidate(i) for i in ids if i != other]
    assert without_other[scoring.session(without_other, session)[0]].replica_id == home
    joined = [Candidate(i) for i in ids] + [Candidate(10_001)]
    assert joined[scoring.session(joined, session)[0]].replica_id in (home, 10_001)
    without_home = [Candidate(i) for i in ids if i != home]
    assert without_home[scoring.session(without_home, session)[0]].replica_id != home


@given(st.lists(st.integers(1, 500), min_size=2, max_size=20, unique=True), st.text(min_size=1, max_size=20))
def test_a_remembered_session_stays_when_replicas_join(ids, key):
    session = session_hash(key)
    cands = [Candidate(i) for i in ids]
    home = cands[scoring.session(cands, session)[0]].replica_id
    joined = cands + [Candidate(1000 + n) for n in range(5)]
    assert joined[scoring.session(joined, session, last=home)[0]].replica_id == home
    # ... unless it is overloaded: then it moves, and says so.
    for c in joined:
        c.inflight = 100 if c.replica_id == home else 0
    index, reason = scoring.session(joined, session, last=home)
    assert joined[index].replica_id != home and reason == "rehome"


def test_consistent_hashing_moves_only_a_share():
    ids = list(range(1, 17))
    keys = [session_hash(f"user-{n}") for n in range(4000)]

    def homes(replicas):
        cands = [Candidate(i) for i in replicas]
        return [cands[scoring.session(cands, k)[0]].replica_id for k in keys]

    before, after = homes(ids), homes(ids[:-1])
    moved = sum(1 for a, b in zip(before, after) if a != b)
    assert moved == before.count(16)  # only the leaver's sessions move
    assert 4000 / 16 * 0.7 < before.count(16) < 4000 / 16 * 1.3  # and it held about its share


@given(st.text(min_size=0, max_size=3000), st.text(min_size=0, max_size=3000))
def test_prompt_blocks_share_exactly_the_common_whole_blocks(common, tail):
    a = prompt_blocks(common + "A" + tail, 64, 200)
    b = prompt_blocks(common + "B" + tail, 64, 200)
    shared = len(common.encode()) // 64
    assert a[:shared] == b[:shared]
    if len(a) > shared and len(b) > shared:
        assert a[shared] != b[shared]


def test_prompt_text_of_chat_and_completions():
    assert prompt_text({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [
        {"type": "text", "text": "Q"}]}]}) == "system\nS\nuser\nQ"
    assert prompt_text({"prompt": "P"}) == "P"
    assert prompt_text({"prompt": [1, 2]}) == "1 2"
    assert prompt_text({"input": "x"}) is None


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 30), st.integers(1, 20)), max_size=60),
       st.integers(4, 40))
def test_prefix_memory_stays_bounded_and_consistent(sends, capacity):
    memory = PrefixMemory()
    for replica, prefix, length in sends:
        blocks = tuple(range(prefix * 100, prefix * 100 + length))
        memory.record(replica, blocks, capacity)
        assert memory.matches(blocks, [replica]) == {replica: min(length, capacity)}
    for replica in memory.replicas():
        assert memory.size(replica) <= capacity
    held = {(b, r) for r, lru in memory.held.items() for b in lru}
    indexed = {(b, r) for b, rs in memory.where.items() for r in rs}
    assert held == indexed
    for replica in list(memory.replicas()):
        memory.forget(replica)
    assert memory.where == {}


def test_prefix_memory_evicts_least_recent_prompts_first():
    memory = PrefixMemory()
    first, second, third = (tuple(range(n * 10, n * 10 + 4)) for n in (1, 2, 3))
    memory.record(1, first, 8)
    memory.record(1, second, 8)
    memory.record(1, first, 8)  # used again: the most recent
    memory.record(1, third, 8)
    assert memory.matches(first, [1]) == {1: 4}
    assert memory.matches(second, [1]) == {}


def _table(policy: str, *replicas: int) -> RoutingTable:
    table = RoutingTable(chars_per_token=1, block_chars=1, cache_tokens=1000)
    table.apply(RoutingSnapshot(catalog={"m": 0}, keys=[], policies={"m": policy},
                                routes=[RouteRow(r, "m", f"http://127.0.0.1:{9000 + r}") for r in replicas]))
    return table


def test_table_cache_aware_follows_the_prefix_and_counts_decisions():
    table = _table(CACHE_AWARE, 1, 2, 3)
    hot = Hints(blocks=tuple(range(20)))
    first = table.pick("m", hints=hot)
    first.inflight += 1
    assert table.pick("m", hints=hot) is first  # the prefix outweighs one request in flight
    assert table.decisions == {("m", "load"): 1, ("m", "prefix"): 1}
    table.apply(RoutingSnapshot(catalog={"m": 0}, keys=[], policies={"m": CACHE_AWARE},
                                routes=[RouteRow(r, "m", f"http://127.0.0.1:{9000 + r}") for r in (1, 2, 3)
                                        if r != first.replica_id]))
    assert first.replica_id not in table.memories["m"].replicas()  # gone: its cache with it


def test_table_session_counts_a_rehome_when_the_home_leaves():
    table = _table(SESSION, 1, 2, 3, 4)
    hints = Hints(session=session_hash("alice"))
    home = table.pick("m", hints=hints)
    assert all(table.pick("m", hints=hints) is home for _ in range(5))
    rest = [r for r in (1, 2, 3, 4) if r != home.replica_id]
    table.apply(RoutingSnapshot(catalog={"m": 0}, keys=[], policies={"m": SESSION},
                                routes=[RouteRow(r, "m", f"http://127.0.0.1:{9000 + r}") for r in rest]))
    assert table.pick("m", hints=hints).replica_id in rest
    assert table.decisions[("m", "rehome")] == 1 and table.decisions[("m", "session")] == 6


def test_engine_metrics_parse_vllm_names():
    page = (b'# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
            b'vllm:num_requests_running{model_name="m"} 3.0\nvllm:num_requests_waiting{model_name="m"} 7.0\n'
            b'vllm:kv_cache_usage_perc{model_name="m"} 0.25\nvllm:prefix_cache_queries_total{model_name="m"} 1000.0\n'
            b'vllm:prefix_cache_hits_total{model_name="m"} 400.0\n'
            b'vllm:cache_config_info{block_size="16",num_gpu_blocks="2048"} 1.0\n')
    reading = parse(page)
    assert (reading.running, reading.waiting, reading.kv_use, reading.hit_rate, reading.cache_tokens) == (
        3, 7, 0.25, 0.4, 32768)
    assert parse(b"vllm:gpu_cache_usage_perc 0.5\n").kv_use == 0.5
    assert reading.backlog is None  # vLLM does not publish it
    assert parse(page + b'llmgw:prefill_backlog_tokens{model_name="m",engine="0"} 1234.0\n').backlog == 1234
    try:
        parse(b"# nothing\nprocess_cpu_seconds_total 1\n")
    except ValueError:
        pass
    else:
        raise AssertionError("a page without vLLM's series is not a reading")


def test_decisions_reach_metrics():
    from gateway.metrics import GatewayMetrics, render

    GatewayMetrics().decisions({("m", "guard"): 2, ("m", "prefix"): 5}, {"m": CACHE_AWARE})
    page = render(None).decode()
    assert 'llmgw_gateway_routing_decisions_total{model="m",policy="cache-aware",reason="guard"}' in page


def test_scraper_reads_engines_and_an_unreadable_one_is_routed_on_own_counts():
    import asyncio
    import socket

    from aiohttp import ClientSession, web

    from gateway.engineload import EngineScraper

    page = (b'vllm:num_requests_running{model_name="m"} 2\nvllm:num_requests_waiting{model_name="m"} 30\n'
            b'vllm:kv_cache_usage_perc{model_name="m"} 0.9\n')

    async def metrics(request):
        return web.Response(body=page)

    async def run():
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            dead = closed.getsockname()[1]
        table = RoutingTable()
        table.apply(RoutingSnapshot(catalog={"m": 0}, keys=[], policies={"m": CACHE_AWARE}, routes=[
            RouteRow(1, "m", f"http://127.0.0.1:{port}"), RouteRow(2, "m", f"http://127.0.0.1:{dead}")]))
        scraper = EngineScraper(interval=1.0, per_second=100, timeout=2.0)
        async with ClientSession() as session:
            readings = await scraper.cycle(session, table.by_model["m"])
        await runner.cleanup()
        return table, readings

    table, readings = asyncio.run(run())
    busy, unread = table.routes[1].engine, table.routes[2].engine
    assert (busy.running, busy.waiting, busy.kv_use, busy.fresh) == (2, 30, 0.9, True)
    assert unread.error and not unread.fresh
    table.routes[2].inflight = 3  # its own count: fewer than the 32 the busy engine says it holds
    for route in table.routes.values():  # both hold the prompt: load decides
        table._remember("m", route, (1, 2, 3))
    assert table.pick("m", hints=Hints(blocks=(1, 2, 3))).replica_id == 2
