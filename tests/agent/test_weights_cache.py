"""The agent's weights cache (agent/weights.py) against a loopback file server
with faults on demand: resume after a cut link and after the agent is killed,
sha256 checked before a file counts, corrupt and truncated files fetched
again, space budget, eviction that never touches weights in use, and the
config section that turns it on."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent.config import ConfigError, load_config, parse_size
from agent.protocol import DesiredWeights, WeightsFile
from agent.weights import WeightsCache, WeightsConfig
from cli.wait import wait_until
from tests.conftest import REPO
from tests.weightservers import WeightsServer

from .conftest import write_yaml


def blob(n: int, seed: int) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (n // 32) + b"x" * (n % 32)


@pytest.fixture
def server():
    with WeightsServer() as s:
        yield s


def desired(server: WeightsServer, model: str, files: dict[str, bytes], revision: str = "r1") -> DesiredWeights:
    base = server.add_files(f"{model}-{revision}", files)
    return DesiredWeights(model=model, revision=revision, files=[
        WeightsFile(name=n, size=len(d), sha256=hashlib.sha256(d).hexdigest(), url=base + n)
        for n, d in sorted(files.items())])


def cache(tmp_path: Path, *, budget: int = 10**9, **kwargs) -> WeightsCache:
    return WeightsCache(WeightsConfig(cache_dir=tmp_path / "cache", budget_bytes=budget, **kwargs))


def complete(c: WeightsCache, key: str, timeout: float = 30.0) -> str:
    wait_until(lambda: c.local_path(key) is not None, timeout=timeout, message=f"{key} complete")
    return c.local_path(key)


def test_fetches_verifies_and_reports(server, tmp_path):
    files = {"config.json": b"{}", "shards/model-1.safetensors": blob(300_000, 1)}
    w = desired(server, "m", files)
    c = cache(tmp_path)
    try:
        c.sync([w], in_use=set())
        path = Path(complete(c, w.key))
        assert path == tmp_path / "cache" / "m" / "r1"
        for name, data in files.items():
            assert (path / name).read_bytes() == data
        report = c.report()
        (entry,) = report.models
        assert (entry.model, entry.revision, entry.complete, entry.bytes, entry.total) == (
            "m", "r1", True, sum(map(len, files.values())), sum(map(len, files.values())))
        assert report.used_bytes >= entry.bytes and 0 < report.free_bytes <= 10**9 - entry.bytes
        assert not list((tmp_path / "cache" / ".partial").rglob("*.part"))
    finally:
        c.close()


@pytest.mark.parametrize("round_", range(5))
def test_a_corrupted_file_is_detected_every_time_and_fetched_again(server, tmp_path, round_):
    files = {f"f{i}.bin": blob(50_000 + i, i + round_) for i in range(3)}
    w = desired(server, "m", files)
    bad = f"/files/m-r1/f{round_ % 3}.bin"
    server.fault(bad, corrupt=True, times=1 + round_ % 2)
    c = cache(tmp_path)
    try:
        c.sync([w], in_use=set())
        path = Path(complete(c, w.key))
        assert c.corrupt_files == 1 + round_ % 2
        for name, data in files.items():
            assert (path / name).read_bytes() == data
        assert server.served[bad] == (2 + round_ % 2) * len(files[bad.rsplit("/", 1)[1]])
    finally:
        c.close()


def test_a_link_cut_mid_file_resumes_with_a_range_request(server, tmp_path):
    data = blob(1_000_000, 7)
    w = desired(server, "m", {"model.safetensors": data})
    path = "/files/m-r1/model.safetensors"
    server.fault(path, cut_after=400_000)
    c = cache(tmp_path)
    try:
        c.sync([w], in_use=set())
        assert (Path(complete(c, w.key)) / "model.safetensors").read_bytes() == data
    finally:
        c.close()
    ranges = [r for method, p, r in server.requests if p == path and method == "GET"]
    assert ranges[0] == "" and ranges[1].startswith("bytes=") and int(ranges[1][6:-1]) > 0
    assert server.served[path] <= len(data) * 1.05


def test_agent_killed_mid_download_resumes_and_fetches_at_most_5_percent_more(server, tmp_path):
    data = blob(4_000_000, 3)
    w = desired(server, "m", {"model.safetensors": data})
    server.rate = 1_000_000  # a slow link: 4 s for the file
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from agent.protocol import DesiredWeights, WeightsFile
        from agent.weights import WeightsCache, WeightsConfig
        w = DesiredWeights(model="m", revision="r1", files=[WeightsFile(**{{
            "name": "model.safetensors", "size": {len(data)}, "sha256": {w.files[0].sha256!r},
            "url": {w.files[0].url!r}}})])
        c = WeightsCache(WeightsConfig(cache_dir=Path({str(tmp_path / 'cache')!r}), budget_bytes=10**9))
        c.sync([w], in_use=set())
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        part = tmp_path / "cache" / ".partial" / "m" / "r1" / "model.safetensors.part"
        wait_until(lambda: part.exists() and part.stat().st_size > 1_500_000, timeout=30, message="half the file")
        assert part.with_name(part.name + ".lock").exists()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    served_before = server.served["/files/m-r1/model.safetensors"]
    assert served_before < len(data)
    server.rate = None
    c = cache(tmp_path)  # the agent again: cleans the lock, keeps the partial file, resumes
    try:
        assert not part.with_name(part.name + ".lock").exists()
        c.sync([w], in_use=set())
        assert (Path(complete(c, w.key)) / "model.safetensors").read_bytes() == data
    finally:
        c.close()
    assert server.served["/files/m-r1/model.safetensors"] <= len(data) * 1.05


def test_truncated_and_corrupt_files_on_disk_are_found_at_start_and_fetched_again(server, tmp_path):
    files = {"a.bin": blob(100_000, 1), "b.bin": blob(100_000, 2)}
    w = desired(server, "m", files)
    c = cache(tmp_path)
    c.sync([w], in_use=set())
    path = Path(complete(c, w.key))
    c.close()
    with open(path / "a.bin", "r+b") as f:  # truncated
        f.truncate(1000)
    raw = bytearray((path / "b.bin").read_bytes())  # corrupt, same size
    raw[500] ^= 0xFF
    (path / "b.bin").write_bytes(bytes(raw))
    c = cache(tmp_path)
    try:
        assert c.local_path(w.key) is None
        c.sync([w], in_use=set())
        wait_until(lambda: c.corrupt_files == 1, timeout=20, message="the corrupt file found")
        complete(c, w.key)
        for name, data in files.items():
            assert (path / name).read_bytes() == data
    finally:
        c.close()


def test_no_space_is_reported_and_nothing_is_fetched(server, tmp_path):
    w = desired(server, "m", {"big.bin": blob(200_000, 1)})
    c = cache(tmp_path, budget=100_000)
    try:
        c.sync([w], in_use=set())
        (entry,) = c.report().models
        assert not entry.complete and entry.error.startswith("no space: needs 200000 more bytes")
        assert server.served["/files/m-r1/big.bin"] == 0
    finally:
        c.close()


def test_eviction_takes_the_least_recently_used_and_never_weights_in_use(server, tmp_path):
    size = 100_000
    old, used, new = (desired(server, name, {"w.bin": blob(size, i)}) for i, name in enumerate(("old", "used", "new")))
    c = cache(tmp_path, budget=int(size * 2.5))
    try:
        c.sync([old, used], in_use=set())
        complete(c, old.key), complete(c, used.key)
        past = time.time() - 3600
        os.utime(tmp_path / "cache" / "used" / "r1" / ".used", (past - 60, past - 60))  # used is older still
        os.utime(tmp_path / "cache" / "old" / "r1" / ".used", (past, past))
        # Only "new" is wanted now, but an engine still runs on "used": "old" goes.
        c.sync([new], in_use={used.key})
        complete(c, new.key)
        assert not (tmp_path / "cache" / "old").exists()
        assert (tmp_path / "cache" / "used" / "r1" / "w.bin").read_bytes() == blob(size, 1)
        # Nothing left to evict but weights in use: no space, and they stay.
        another = desired(server, "another", {"w.bin": blob(size, 9)})
        c.sync([another], in_use={used.key, new.key})
        entry = next(m for m in c.report().models if m.model == "another")
        assert entry.error.startswith("no space")
        assert (tmp_path / "cache" / "used" / "r1" / "w.bin").exists() and (tmp_path / "cache" / "new" / "r1").exists()
    finally:
        c.close()


def test_downloads_are_bounded_and_the_bandwidth_capped(server, tmp_path):
    files = {f"f{i}.bin": blob(60_000, i) for i in range(4)}
    w = desired(server, "m", files)
    c = cache(tmp_path, downloads=1, bandwidth=200_000)
    began = time.monotonic()
    try:
        c.sync([w], in_use=set())
        complete(c, w.key)
    finally:
        c.close()
    assert server.max_active == 1
    # The cap charges each chunk as it arrives: all but the last one waited.
    assert time.monotonic() - began >= (240_000 - 65_536) / 200_000


def test_stale_partials_of_weights_no_longer_wanted_are_removed(server, tmp_path):
    w = desired(server, "m", {"w.bin": blob(100_000, 1)})
    stale = tmp_path / "cache" / ".partial" / "gone" / "r0" / "x.part"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half")
    (tmp_path / "cache" / "m" / "r1").mkdir(parents=True)
    (tmp_path / "cache" / "m" / "r1" / "w.bin.tmp").write_bytes(b"left by a crash")
    c = cache(tmp_path)
    try:
        assert not (tmp_path / "cache" / "m" / "r1" / "w.bin.tmp").exists()
        c.sync([w], in_use=set())
        complete(c, w.key)
        assert not stale.exists()
    finally:
        c.close()


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../b", "", "ok/./x"])
def test_a_file_name_that_leaves_the_cache_is_refused(server, tmp_path, name):
    w = DesiredWeights(model="m", revision="r1", files=[WeightsFile(name=name, size=1, sha256="0" * 64,
                                                                    url=server.url + "/files/x")])
    c = cache(tmp_path)
    try:
        c.sync([w], in_use=set())
        (entry,) = c.report().models
        assert "not a relative path" in entry.error and not entry.complete
        assert not server.requests
    finally:
        c.close()


def test_present_weights_read_in_place(tmp_path):
    shared = tmp_path / "shared" / "m"
    c = cache(tmp_path)
    try:
        w = DesiredWeights(model="m", revision="local", path=str(shared))
        c.sync([w], in_use=set())
        assert c.local_path(w.key) is None and "is not on this node" in c.report().models[0].error
        shared.mkdir(parents=True)
        (shared / "config.json").write_text("{}")
        c.sync()
        assert c.local_path(w.key) == str(shared) and c.report().models[0].complete
    finally:
        c.close()


# --- agent.yaml -------------------------------------------------------------------------------


@pytest.fixture
def config_path(sim_node):
    return sim_node("node01", server="https://127.0.0.1:7443", gpus=1)


def test_weights_section_of_the_agent_config(config_path, tmp_path):
    assert load_config(config_path).weights is None
    write_yaml(config_path, weights={"cache_dir": str(tmp_path / "c"), "budget": "2TiB", "bandwidth": "200M",
                                     "downloads": 4})
    weights = load_config(config_path).weights
    assert (weights.cache_dir, weights.budget_bytes, weights.bandwidth, weights.downloads, weights.verify_on_start) == (
        tmp_path / "c", 2 * 1024**4, 200 * 10**6, 4, True)


@pytest.mark.parametrize(("section", "words"), [
    ({"cache_dir": "/x", "budget": "lots"}, "weights.budget: 'lots' is not a size"),
    ({"cache_dir": "/x"}, "weights.budget: missing"),
    ({"cache_dir": "/x", "budget": "1G", "bandwith": "1M"}, "weights.bandwith: unknown key; did you mean 'bandwidth'?"),
    ({"cache_dir": "/x", "budget": "1G", "downloads": 0}, "weights.downloads: must be a whole number of at least 1"),
    ({"budget": "1G"}, "weights.cache_dir: missing"),
])
def test_weights_section_is_checked_strictly(config_path, section, words):
    write_yaml(config_path, weights=section)
    with pytest.raises(ConfigError) as info:
        load_config(config_path)
    assert any(e.startswith(words) for e in info.value.errors), info.value.errors


def test_sizes():
    assert parse_size("500G") == 500 * 10**9 and parse_size("1.5T") == 1.5 * 10**12
    assert parse_size("800GiB") == 800 * 1024**3 and parse_size(1000) == 1000
    assert parse_size("-1G") is None and parse_size(True) is None and parse_size("1X") is None


# --- engines start with the local path, once the weights are there ------------------------------


def test_a_member_starts_only_once_its_weights_are_there_with_their_local_path(tmp_path):
    from agent.config import SupervisorConfig
    from agent.protocol import WEIGHTS_PATH_ARG, DesiredMember, DesiredState
    from agent.supervisor import Supervisor

    supervisor = Supervisor(SupervisorConfig(work_dir=tmp_path / "work", stop_timeout=1.0, health_interval=0.1))
    code = "import sys, time; print('weights at', sys.argv[1], flush=True); time.sleep(60)"
    member = DesiredMember(member="m-1", replica="r1", model="m", rank=0, engine="vllm",
                           argv=["{python}", "-c", code, WEIGHTS_PATH_ARG], env={"MODEL_DIR": WEIGHTS_PATH_ARG},
                           gpus=[0], ports={}, serves_http=False, weights="m@r1")
    desired = DesiredState(version=1, members=[member])
    where: dict[str, str] = {}
    try:
        supervisor.converge(desired, weights_path=where.get)
        assert supervisor.engines() == {}  # not there yet: not started
        where["m@r1"] = str(tmp_path / "cache" / "m" / "r1")
        supervisor.converge(desired, weights_path=where.get)
        engine = supervisor.engines()["m-1"]
        assert engine.spec.argv[-1] == where["m@r1"] and engine.spec.env["MODEL_DIR"] == where["m@r1"]
        assert supervisor.weights_in_use() == {"m@r1"}
        # Converging again (the same desired state) leaves it alone.
        supervisor.converge(desired, weights_path=where.get)
        assert supervisor.engines()["m-1"] is engine
    finally:
        supervisor.converge(DesiredState(version=2))
        wait_until(lambda: (supervisor.tick(), not supervisor.engines())[1], timeout=15, message="engines stopped")
        supervisor.close()
