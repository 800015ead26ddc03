"""The simulated engine as real processes: rendezvous, serving, breaking."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import REPO, free_port

from .conftest import listening_ports, wait_until


@pytest.fixture
def sim(tmp_path):
    """start(rank, nnodes, rendezvous_port, http_port, fabric=..., model=...) -> Popen."""
    procs: list[subprocess.Popen] = []

    def start(rank: int, nnodes: int, rendezvous: int, http: int, *, fabric: str = "ib-a",
              model: str = "sim-model", host: str = "127.0.0.1", via_llmgw: bool = False) -> subprocess.Popen:
        entry = ["cli", "sim", "engine"] if via_llmgw else ["agent.engines.sim"]
        argv = [sys.executable, "-m", *entry, "--rank", str(rank), "--nnodes", str(nnodes),
                "--rendezvous", f"127.0.0.1:{rendezvous}", "--host", host, "--port", str(http),
                "--model", model, "--fabric", fabric, "--token-delay", "0.005", "--peer-timeout", "3"]
        log_path = tmp_path / f"sim-{len(procs)}-rank{rank}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc.log_path = log_path
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def exit_code(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pid {proc.pid} still running after {timeout}s")


def test_leader_serves_only_once_every_worker_joined_and_workers_never_listen(sim):
    rendezvous, http = free_port(), free_port()
    leader = sim(0, 3, rendezvous, http)
    wait_until(lambda: rendezvous in listening_ports(leader.pid), 15, message="rendezvous bound")
    worker1 = sim(1, 3, rendezvous, http)
    wait_until(lambda: b"rank 1 joined from" in _log_of(leader), 15, message="worker 1 joined")
    assert listening_ports(leader.pid) == {rendezvous}, "one of two workers joined: not serving yet"
    assert not healthy(http)
    worker2 = sim(2, 3, rendezvous, http)
    wait_until(lambda: healthy(http), 15, message="leader serving")
    assert listening_ports(leader.pid) == {rendezvous, http}
    for worker in (worker1, worker2):
        assert worker.poll() is None
        assert listening_ports(worker.pid) == set(), "a worker has no listening socket at all"

    # One member gone: the group is broken and every member exits non-zero.
    worker2.send_signal(signal.SIGKILL)
    assert exit_code(leader) == 1
    assert exit_code(worker1) == 1


def test_the_leader_going_away_breaks_the_workers(sim):
    rendezvous, http = free_port(), free_port()
    leader = sim(0, 2, rendezvous, http)
    worker = sim(1, 2, rendezvous, http)
    wait_until(lambda: healthy(http), 15, message="leader serving")
    leader.send_signal(signal.SIGKILL)
    assert exit_code(worker) == 1


def test_workers_may_start_before_the_leader(sim):
    rendezvous, http = free_port(), free_port()
    worker = sim(1, 2, rendezvous, http)
    wait_until(lambda: b"rank 1 joining rendezvous" in _log_of(worker), 15, message="the worker trying to join")
    assert worker.poll() is None and listening_ports(worker.pid) == set()
    leader = sim(0, 2, rendezvous, http)
    wait_until(lambda: healthy(http), 15, message="leader serving")
    leader.send_signal(signal.SIGTERM)
    assert exit_code(leader) == 0, "stopped on request"
    assert exit_code(worker) == 1, "but for the worker, the group broke"


def test_members_on_different_fabrics_never_become_healthy(sim):
    rendezvous, http = free_port(), free_port()
    leader = sim(0, 2, rendezvous, http, fabric="ib-a")
    worker = sim(1, 2, rendezvous, http, fabric="ib-b")
    wait_until(lambda: b"will never complete" in _log_of(leader), 15, message="group formed")
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert not healthy(http), "a group spanning two fabrics must never serve"
        time.sleep(0.2)
    assert leader.poll() is None and worker.poll() is None, "hung, not crashed: as NCCL does"
    assert http not in listening_ports(leader.pid)


def _log_of(proc: subprocess.Popen) -> bytes:
    return proc.log_path.read_bytes()


def test_a_worker_with_a_wrong_rank_or_model_is_refused(sim):
    rendezvous, http = free_port(), free_port()
    leader = sim(0, 2, rendezvous, http)
    stranger = sim(1, 2, rendezvous, http, model="another-model")
    assert exit_code(stranger) == 2
    worker = sim(1, 2, rendezvous, http)
    wait_until(lambda: healthy(http), 15, message="leader serving")
    assert leader.poll() is None and worker.poll() is None


def test_single_node_serves_the_openai_api(sim):
    """Started as ``llmgw sim engine``, the alias of ``python -m agent.engines.sim``."""
    http = free_port()
    leader = sim(0, 1, free_port(), http, fabric="", via_llmgw=True)
    wait_until(lambda: healthy(http), 15, message="serving")
    assert listening_ports(leader.pid) == {http}, "a single node binds no rendezvous"
    base = f"http://127.0.0.1:{http}"
    with httpx.Client(base_url=base, timeout=10) as client:
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["sim-model"] and models["object"] == "list"

        chat = client.post("/v1/chat/completions", json={
            "model": "sim-model", "messages": [{"role": "user", "content": "say four words please"}], "max_tokens": 4,
        }).json()
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert len(chat["choices"][0]["message"]["content"].split()) == 4
        assert chat["choices"][0]["finish_reason"] == "length"
        assert chat["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                                 "prompt_tokens_details": {"cached_tokens": 0}}

        completion = client.post("/v1/completions", json={"model": "sim-model", "prompt": "once upon"}).json()
        assert completion["object"] == "text_completion" and completion["choices"][0]["finish_reason"] == "stop"
        assert completion["usage"]["prompt_tokens"] == 2
        assert completion["usage"]["completion_tokens"] == len(completion["choices"][0]["text"].split())

        events = []
        with client.stream("POST", "/v1/chat/completions", json={
            "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True},
        }) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        tokens = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
        assert len([t for t in tokens if t]) == chunks[-1]["usage"]["completion_tokens"] > 1
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 2 + len([t for t in tokens if t])

        text_events = []
        with client.stream("POST", "/v1/completions", json={
            "model": "sim-model", "prompt": "x", "stream": True, "max_tokens": 3,
        }) as response:
            text_events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert text_events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in text_events[:-1]).split() == \
            chat["choices"][0]["message"]["content"].split()[:3]

        missing = client.post("/v1/chat/completions", json={"model": "other", "messages": []})
        assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]
        bad = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400
    leader.send_signal(signal.SIGTERM)
    assert exit_code(leader) == 0


def _metrics(client: httpx.Client) -> dict[str, float]:
    """The engine's /metrics as {name: value} (one model, one series each), read with prometheus-client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.labels.get("model_name") == "sim-model" and "le" not in sample.labels:
                values[sample.name] = sample.value
    return values


def _first_token_after(client: httpx.Client, prompt: str) -> tuple[float, dict]:
    """Seconds to the first streamed token, and the usage of the final chunk."""
    started = time.monotonic()
    first, usage = None, None
    with client.stream("POST", "/v1/completions", json={
        "model": "sim-model", "prompt": prompt, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True},
    }) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.monotonic() - started
            usage = event.get("usage") or usage
    return first, usage


def test_a_repeated_long_prefix_is_answered_from_cache_and_a_full_batch_queues(tmp_path):
    """A real sim engine: the second request with the same 4,000-token prefix
    finds it cached (vLLM's cached_tokens) and its first token comes sooner;
    requests beyond --max-num-seqs wait, and /metrics says so."""
    http = free_port()
    argv = [sys.executable, "-m", "agent.engines.sim", "--rank", "0", "--nnodes", "1", "--port", str(http),
            "--model", "sim-model", "--max-num-seqs", "2", "--prefill-time-per-token", "0.0002",
            "--prefill-overhead", "0.01", "--decode-step-base", "0.02", "--decode-step-per-seq", "0"]
    with open(tmp_path / "sim.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: healthy(http), 15, message="serving")
        prefix = " ".join(f"doc{i}" for i in range(4000))
        with httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=30) as client:
            cold, cold_usage = _first_token_after(client, prefix + " first question?")
            warm, warm_usage = _first_token_after(client, prefix + " another question?")
            assert cold_usage["prompt_tokens_details"] == {"cached_tokens": 0}
            assert warm_usage["prompt_tokens_details"]["cached_tokens"] == 4000  # 250 blocks of 16
            assert cold >= 0.8  # 4,002 uncached tokens x 0.2 ms
            assert warm < cold / 3, (cold, warm)
            plain = client.post("/v1/completions", json={"model": "sim-model", "prompt": prefix, "max_tokens": 2})
            assert plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3984  # the last block recomputed
            seen = _metrics(client)
            assert seen["vllm:prefix_cache_queries_total"] == 4002 + 4002 + 4000
            assert seen["vllm:prefix_cache_hits_total"] == 4000 + 3984
            assert seen["vllm:time_to_first_token_seconds_count"] == 3
            assert seen["vllm:num_requests_running"] == seen["vllm:num_requests_waiting"] == 0

            # Five requests of 40 tokens (about 0.8 s each) on a batch of two.
            def ask(i: int, max_tokens: int = 40) -> int:
                body = {"model": "sim-model", "prompt": f"question {i}", "max_tokens": max_tokens}
                return httpx.post(f"http://127.0.0.1:{http}/v1/completions", json=body, timeout=30).status_code

            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(5) as pool:
                futures = [pool.submit(ask, i) for i in range(5)]
                busy = wait_until(lambda: (lambda m: m if m["vllm:num_requests_waiting"] == 3 else None)(
                    _metrics(client)), 10, interval=0.02, message="three requests waiting")
                assert busy["vllm:num_requests_running"] == 2 and busy["vllm:kv_cache_usage_perc"] > 0
                assert [f.result() for f in futures] == [200] * 5
            done = _metrics(client)
            assert done["vllm:num_requests_waiting"] == 0 and done["vllm:request_success_total"] == 8
            assert done["vllm:request_queue_time_seconds_sum"] > 0.5  # the last ones waited two turns

            # A client that gives up while queued leaves the queue (vLLM aborts it).
            with ThreadPoolExecutor(2) as pool:
                futures = [pool.submit(ask, i, 250) for i in range(2)]  # 5 s each
                wait_until(lambda: _metrics(client)["vllm:num_requests_running"] == 2, 10, interval=0.02,
                           message="a full batch")
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(f"http://127.0.0.1:{http}/v1/completions", timeout=0.3,
                               json={"model": "sim-model", "prompt": "impatient", "max_tokens": 5})
                wait_until(lambda: _metrics(client)["vllm:num_requests_waiting"] == 0, 3, interval=0.02,
                           message="the abandoned request gone from the queue (it looks every second)")
                assert _metrics(client)["vllm:num_requests_running"] == 2
                assert [f.result() for f in futures] == [200] * 2
            assert _metrics(client)["vllm:request_success_total"] == 10  # the abandoned one is no success
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_metrics_report_the_prefill_backlog_while_a_long_prompt_is_prefilled(tmp_path):
    """llmgw:prefill_backlog_tokens: the prompt tokens still to prefill, read
    while a 5,000-token prompt goes through a slow lane, and none after."""
    http = free_port()
    argv = [sys.executable, "-m", "agent.engines.sim", "--rank", "0", "--nnodes", "1", "--port", str(http),
            "--model", "sim-model", "--prefill-time-per-token", "0.0005", "--prefill-overhead", "0"]
    with open(tmp_path / "sim.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: healthy(http), 15, message="serving")
        with httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=30) as client:
            assert _metrics(client)["llmgw:prefill_backlog_tokens"] == 0
            from concurrent.futures import ThreadPoolExecutor

            prompt = " ".join(f"w{i}" for i in range(5000))  # 2.5 s of prefill
            with ThreadPoolExecutor(1) as pool:
                future = pool.submit(client.post, "/v1/completions",
                                     json={"model": "sim-model", "prompt": prompt, "max_tokens": 1})
                seen = wait_until(lambda: (lambda m: m if m["vllm:num_requests_running"] == 1 else None)(
                    _metrics(client)), 10, interval=0.02, message="the request running")
                assert 0 < seen["llmgw:prefill_backlog_tokens"] <= 5000
                later = _metrics(client)["llmgw:prefill_backlog_tokens"]
                assert later < seen["llmgw:prefill_backlog_tokens"]  # the lane works it off
                assert future.result().status_code == 200
            assert _metrics(client)["llmgw:prefill_backlog_tokens"] == 0
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
