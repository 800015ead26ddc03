"""The sim engine's performance model as arithmetic: hits, sharing, eviction,
queueing and the time to first token, on a clock the test holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.engines.sim_model import PrefixCache, RequestTooLarge, SimEngine, SimParams, block_hashes

FLAT = dict(prefill_overhead=0.0, prefill_time_per_token=0.0, decode_step_base=0.0, decode_step_per_seq=0.0)


def words(n: int, tag: str = "w") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def engine(**overrides) -> SimEngine:
    return SimEngine(SimParams(**{"block_size": 4, "num_gpu_blocks": 100, "max_model_len": 400, **overrides}))


def test_block_hashes_are_chained_and_cover_full_blocks_only():
    a = block_hashes(words(10), 4)
    assert len(a) == 2  # the partial third block has no hash
    assert block_hashes(words(8), 4) == a
    # The same second block after a different first one is a different block.
    b = block_hashes(["x"] + words(10)[1:], 4)
    assert b[0] != a[0] and b[1] != a[1]
    assert block_hashes(words(8), 4) == block_hashes(list(words(8)), 4)  # deterministic


def test_a_repeated_prompt_hits_every_block_but_the_one_holding_its_last_token():
    e = engine()
    first = e.submit(words(40), 5, now=0.0)
    assert first.admitted.is_set() and first.cached_tokens == 0
    e.computed(first)
    e.finish(first, now=1.0)
    again = e.submit(words(40), 5, now=2.0)
    assert again.cached_tokens == 36  # 40 tokens = 10 blocks; the 10th holds the last token
    longer = e.submit(words(40) + words(9, "new"), 5, now=2.0)
    assert longer.cached_tokens == 40  # its prefix is the whole earlier prompt
    assert (e.prefix_queries, e.prefix_hits) == (40 + 40 + 49, 36 + 40)


def test_ttft_is_queue_wait_plus_overhead_plus_uncached_tokens_through_one_prefill_lane():
    e = engine(prefill_overhead=0.01, prefill_time_per_token=0.001, max_num_seqs=1)
    a = e.submit(words(100), 3, now=0.0)
    assert a.first_token_at == pytest.approx(0.0 + 100 * 0.001 + 0.01) and a.ttft == pytest.approx(0.11)
    b = e.submit(words(100), 3, now=0.05)  # same prompt, but a is running: b waits for the slot
    assert not b.admitted.is_set() and len(e.waiting) == 1
    e.computed(a)
    e.finish(a, now=0.5)
    assert b.admitted.is_set() and b.queue_time == pytest.approx(0.45)
    assert b.cached_tokens == 96
    assert b.ttft == pytest.approx(0.45 + 4 * 0.001 + 0.01)


def test_concurrent_prefills_take_turns_in_the_lane():
    e = engine(prefill_overhead=0.0, prefill_time_per_token=0.001)
    a = e.submit(words(200, "a"), 1, now=0.0)
    b = e.submit(words(100, "b"), 1, now=0.0)
    assert a.first_token_at == pytest.approx(0.2)
    assert b.first_token_at == pytest.approx(0.3)  # after a's prefill
    c = e.submit(words(10, "c"), 1, now=1.0)  # the lane is idle again
    assert c.first_token_at == pytest.approx(1.01)


def test_prefill_backlog_is_the_lanes_unfinished_tokens_and_the_waiting_ones_less_their_hits():
    e = engine(prefill_overhead=0.0, prefill_time_per_token=0.001, max_num_seqs=2)
    assert e.snapshot(0.0)["prefill_backlog"] == 0
    a = e.submit(words(200, "a"), 1, now=0.0)
    e.submit(words(100, "b"), 1, now=0.0)
    assert e.snapshot(0.0)["prefill_backlog"] == 300
    assert e.snapshot(0.25)["prefill_backlog"] == 50  # a done, half of b
    # Waiting (the batch is full): a prompt that starts with a's computed
    # blocks counts only what the cache would not give it.
    e.computed(a)
    e.submit(words(200, "a") + words(20, "q"), 1, now=0.25)
    e.submit(words(30, "c"), 1, now=0.25)
    assert e.snapshot(0.25)["prefill_backlog"] == 50 + 20 + 30
    assert e.snapshot(5.0)["prefill_backlog"] == 20 + 30
    assert "prefill_backlog" not in e.snapshot()  # no clock, no backlog


def test_requests_past_max_num_seqs_wait_first_come_first_served():
    e = engine(max_num_seqs=2, **FLAT)
    tickets = [e.submit(words(4, f"r{i}"), 1, now=float(i)) for i in range(5)]
    assert [t.admitted.is_set() for t in tickets] == [True, True, False, False, False]
    assert e.snapshot()["running"] == 2 and e.snapshot()["waiting"] == 3
    e.finish(tickets[1], now=10.0)
    assert [t.admitted.is_set() for t in tickets] == [True, True, True, False, False]
    e.finish(tickets[4], now=11.0)  # a waiting request that gives up leaves the queue
    assert e.snapshot()["waiting"] == 1
    e.finish(tickets[0], now=12.0)
    assert tickets[3].admitted.is_set() and tickets[3].queue_time == pytest.approx(9.0)


def test_the_head_of_the_queue_waits_for_blocks_and_nobody_overtakes_it():
    e = engine(num_gpu_blocks=10, max_model_len=40, **FLAT)
    big = e.submit(words(24, "big"), 4, now=0.0)  # 7 blocks
    huge = e.submit(words(30, "huge"), 2, now=0.0)  # 8 blocks: only 3 free
    small = e.submit(words(3, "s"), 1, now=0.0)  # 1 block would fit, but waits behind huge
    assert big.admitted.is_set() and not huge.admitted.is_set() and not small.admitted.is_set()
    assert e.cache.usage() == pytest.approx(0.7)
    e.computed(big)
    e.finish(big, now=1.0)
    assert huge.admitted.is_set() and small.admitted.is_set()
    with pytest.raises(RequestTooLarge, match="needs 11 KV blocks"):
        e.submit(words(40), 1, now=2.0)


def test_unreferenced_blocks_are_evicted_least_recently_used_tail_first():
    e = engine(num_gpu_blocks=8, max_model_len=32, **FLAT)
    for tag, now in (("a", 0.0), ("b", 1.0)):
        t = e.submit(words(12, tag), 4, now=now)  # 3 prompt blocks cached, 1 output block
        e.computed(t)
        e.finish(t, now=now + 0.5)
    assert len(e.cache.refs) == 6 and e.cache.used == 0 and e.cache.usage() == 0
    # Needs 4 fresh blocks of 8, 6 cached and free: evicts 2, a's, its last ones first.
    c = e.submit(words(12, "c"), 4, now=2.0)
    assert c.admitted.is_set() and e.cache.evictions == 2
    e.finish(c, now=3.0)
    a_again = e.submit(words(12, "a") + ["x"], 1, now=4.0)
    assert a_again.cached_tokens == 4  # a's first block survived, its second and third did not
    b_again = e.submit(words(12, "b") + ["x"], 1, now=4.0)
    assert b_again.cached_tokens == 12


def test_running_requests_share_their_prefix_blocks_and_keep_them_from_eviction():
    e = engine(num_gpu_blocks=10, max_model_len=40, **FLAT)
    first = e.submit(words(16, "p") + ["q1"], 3, now=0.0)  # 5 blocks: 4 prompt blocks are full
    e.computed(first)
    used = e.cache.used
    second = e.submit(words(16, "p") + ["q2"], 3, now=0.1)
    assert second.cached_tokens == 16 and e.cache.used == used + 1  # shares 4, takes 1 fresh
    assert all(e.cache.refs[h] == 2 for h in first.held[:4])
    # A request that would need the shared blocks' room waits instead of evicting them.
    other = e.submit(words(20, "o"), 4, now=0.2)
    assert not other.admitted.is_set()
    e.finish(first, now=1.0)
    assert not other.admitted.is_set()  # second still holds the prefix
    e.finish(second, now=2.0)
    assert other.admitted.is_set()


def test_without_prefix_caching_nothing_hits():
    e = engine(enable_prefix_caching=False)
    for now in (0.0, 1.0):
        t = e.submit(words(40), 2, now=now)
        e.computed(t)
        e.finish(t, now=now + 0.5)
        assert t.cached_tokens == 0
    assert e.prefix_hits == 0 and e.cache.used == 0


def test_decode_steps_grow_with_the_running_count():
    p = SimParams(decode_step_base=0.01, decode_step_per_seq=0.001)
    assert p.decode_step(1) == pytest.approx(0.011) and p.decode_step(100) == pytest.approx(0.11)


def test_parameters_that_cannot_work_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--max-model-len 32768 is more than the KV cache holds"):
        SimEngine(SimParams(num_gpu_blocks=100))
    assert SimParams(max_num_seqs=0, prefill_overhead=-1).problems() == [
        "--max-num-seqs must be at least 1", "--prefill-overhead must be a finite number of seconds >= 0"]
    assert SimParams().problems() == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40), st.integers(1, 8), st.booleans()),
                min_size=1, max_size=40))
def test_block_accounting_holds_under_any_sequence(requests):
    """Whatever arrives and finishes, blocks are never over-committed and all
    return when everything is done."""
    e = engine(num_gpu_blocks=24, max_model_len=48, max_num_seqs=3, **FLAT)
    live = []
    for i, (prefix, length, output, finish_one) in enumerate(requests):
        live.append(e.submit(words(length, f"p{prefix}-"), output, now=float(i)))
        for t in live:
            if t.admitted.is_set():
                e.computed(t)
        if finish_one and live:
            e.finish(live.pop(0), now=float(i) + 0.5)
        cache = e.cache
        assert 0 <= cache.used <= cache.capacity and cache.private + len(cache.refs) <= cache.capacity
        assert e.running <= 3 and e.running == sum(1 for t in live if t.admitted.is_set())
        assert all(n > 0 for h, n in cache.refs.items() if h not in cache.free)
    for t in list(live):
        e.finish(t, now=1000.0)
    assert e.cache.used == 0 and e.running == 0 and not e.waiting


def test_the_engines_flags_make_the_parameters_and_token_delay_keeps_its_flat_timing(capsys):
    from agent.engines.sim import parse_args

    base = ["--rank", "0", "--nnodes", "1", "--model", "m"]
    assert parse_args(base).params == SimParams()
    flat = parse_args(base + ["--token-delay", "0.01"]).params
    assert (flat.decode_step_base, flat.decode_step_per_seq, flat.prefill_overhead, flat.prefill_time_per_token) == (
        0.01, 0.0, 0.0, 0.0)
    mixed = parse_args(base + ["--token-delay", "0.01", "--prefill-time-per-token", "0.001"]).params
    assert (mixed.decode_step_base, mixed.prefill_time_per_token) == (0.01, 0.001)
    vllm_names = parse_args(base + ["--max-num-seqs", "8", "--block-size", "32", "--num-gpu-blocks-override", "64",
                                    "--max-model-len", "2048", "--no-enable-prefix-caching"]).params
    assert vllm_names == SimParams(max_num_seqs=8, block_size=32, num_gpu_blocks=64, max_model_len=2048,
                                   enable_prefix_caching=False)
    with pytest.raises(SystemExit):
        parse_args(base + ["--num-gpu-blocks-override", "10"])
    assert "--max-model-len 32768 is more than the KV cache holds" in capsys.readouterr().err


def test_a_prompt_is_words_and_a_marker_per_chat_message():
    from agent.engines.sim_api import _prompt_tokens

    chat = {"messages": [{"role": "system", "content": "You are  terse."},
                         {"role": "user", "content": [{"type": "text", "text": "two words"}, {"type": "image_url"}]}]}
    assert _prompt_tokens(chat, chat=True) == ["<|system|>", "You", "are", "terse.", "<|user|>", "two", "words"]
    assert _prompt_tokens({"prompt": "a b\nc"}, chat=False) == ["a", "b", "c"]
    assert _prompt_tokens({"prompt": ["a b", 7]}, chat=False) == ["a", "b", "7"]
    # The same conversation with one more turn extends the same blocks.
    longer = {"messages": chat["messages"] + [{"role": "assistant", "content": "ok"}]}
    first, second = _prompt_tokens(chat, chat=True), _prompt_tokens(longer, chat=True)
    assert second[:len(first)] == first
    assert block_hashes(second, 2)[:3] == block_hashes(first, 2)
