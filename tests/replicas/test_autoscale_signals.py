"""The engines' load as the autoscaler reads it: the sim engine's real
/metrics exposition (vLLM's names) parsed into waiting, running and KV use."""

from __future__ import annotations

from types import SimpleNamespace

from agent.engines.sim_metrics import SimMetrics
from replicas.autoscaling.signals import EngineLoad, engine_totals, parse_engine_metrics


class _Engine:
    params = SimpleNamespace(block_size=16, enable_prefix_caching=True, num_gpu_blocks=25000)

    def __init__(self, running: int, waiting: int, kv: float) -> None:
        self.state = {"running": running, "waiting": waiting, "kv_cache_usage": kv, "prefix_queries": 0,
                      "prefix_hits": 0, "prompt_tokens": 0, "generation_tokens": 0, "finished": 0}

    def snapshot(self, now: float | None = None) -> dict:
        return self.state if now is None else {**self.state, "prefill_backlog": 0}


def test_the_sim_engines_metrics_are_read_by_their_vllm_names():
    text = SimMetrics("qwen", _Engine(running=32, waiting=7, kv=0.63)).exposition().decode()
    assert parse_engine_metrics(text) == EngineLoad(waiting=7, running=32, kv_usage=0.63)


def test_totals_over_replicas():
    loads = {1: EngineLoad(3, 10, 0.5), 2: EngineLoad(5, 12, None), 3: EngineLoad(0, 2, 0.7)}
    waiting, running, kv = engine_totals(loads)
    assert (waiting, running) == (8, 24) and abs(kv - 0.6) < 1e-9
    assert engine_totals({}) == (None, None, None)
