"""`llmgw demo` on a fresh machine's embedded default: four simulated nodes
come up, the sample catalog becomes ready, and the curl and openai snippets
it prints work as printed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.test_up import descendants, embedded_env, llmgw_argv

pytestmark = pytest.mark.e2e


def _block(text: str, start: str, end: str) -> str:
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip().startswith(start))
    last = next(i for i in range(first + 1, len(lines)) if lines[i].strip().startswith(end))
    return "\n".join(line[2:] for line in lines[first:last + 1])


def test_demo_comes_up_and_its_snippets_work(tmp_path):
    web_port, agent_port = free_port(), free_port()
    data = tmp_path / "demo"
    log = tmp_path / "demo.log"
    env = embedded_env()
    proc = subprocess.Popen(
        [*llmgw_argv(), "demo", "--data-dir", str(data), "--web-port", str(web_port), "--agent-port", str(agent_port)],
        env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C stops everything." not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        printed = log.read_text()
        key = re.search(r"export LLMGW_KEY=(\S+)", printed)[1]
        ctl_env = dict(env, LLMGW_DATA_DIR=str(data), LLMGW_URL=f"http://127.0.0.1:{web_port}")

        def ready() -> int:
            out = subprocess.run([*llmgw_argv(), "ctl", "replicas", "-o", "json"], env=ctl_env,
                                 capture_output=True, text=True, timeout=60).stdout
            return sum(r["status"] == "ready" for r in json.loads(out or "[]"))

        while ready() < 4:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(1)
        snippet_env = dict(env, LLMGW_KEY=key)
        curl = subprocess.run(["bash", "-c", _block(printed, "curl ", "-d ")], env=snippet_env,
                              capture_output=True, text=True, timeout=60)
        assert curl.returncode == 0, curl.stderr
        assert "data: " in curl.stdout and "[DONE]" in curl.stdout
        # As printed: the demo's own interpreter, which has the openai package.
        script = _block(printed, f"{Path(llmgw_argv()[0]).with_name('python')} - <<'PY'", "PY")
        python = subprocess.run(["bash", "-c", script], env=snippet_env, capture_output=True, text=True, timeout=60)
        assert python.returncode == 0, python.stderr
        assert "qwen-7b-sim" in python.stdout
        below = descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/proc/{pid}") and _not_zombie(pid) for pid in below):
        assert time.monotonic() < deadline, "processes of the demo outlived it"
        time.sleep(0.2)


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- the story the demo tells, as printed, and the README's tour ------------------


def _tour_commands(readme: str) -> list[str]:
    section = readme.split("## A tour of the demo", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def _guide_commands(printed: str) -> list[str]:
    guide = printed.split("llmgw demo is up", 1)[1]
    return [line[2:] for line in guide.splitlines()
            if line.startswith("  export LLMGW_DATA_DIR=") or line.startswith("  .venv/bin/llmgw ")]


def _sqlite_count(db, sql: str) -> int:
    import sqlite3

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return conn.execute(sql).fetchone()[0]


def test_the_demo_story_as_printed_and_the_readme_tour(tmp_path):
    """From a checkout-shaped directory (``.venv`` and ``var/demo`` in it), as
    ``make demo`` runs it: every command the demo prints, in order, does what
    the guide says, and they are the README's tour, command for command."""
    from tests.conftest import REPO

    web_port, agent_port = free_port(), free_port()
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    log = tmp_path / "demo.log"
    env = embedded_env()
    proc = subprocess.Popen(
        [".venv/bin/llmgw", "demo", "--web-port", str(web_port), "--agent-port", str(agent_port)],
        env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=tmp_path,
    )
    db = tmp_path / "var" / "demo" / "llmgw.sqlite3"
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C stops everything." not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        printed = log.read_text()
        commands = _guide_commands(printed)
        tour = [line.replace("127.0.0.1:8000", f"127.0.0.1:{web_port}") for line in
                _tour_commands((REPO / "README.md").read_text())]
        assert commands == tour, "the README's tour is not what the demo prints"
        export, *steps = commands
        assert [s.split()[1:3] for s in steps] == [
            ["ctl", "nodes"], ["ctl", "replicas"], ["ctl", "events"], ["demo", "kill"], ["demo", "revive"],
            ["demo", "gpu-fail"], ["demo", "gpu-fail"], ["ctl", "gpus"], ["ctl", "drain"]]

        def run(command: str, timeout: float = 60) -> str:
            done = subprocess.run(["bash", "-c", f"{export}\n{command}"], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=timeout)
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            return done.stdout

        def as_json(command: str):
            return json.loads(run(command + " -o json"))

        def replicas():
            return as_json(".venv/bin/llmgw ctl replicas")

        def ready(model: str, fabric: str | None = None) -> list[dict]:
            return [r for r in replicas() if r["model"] == model and r["status"] == "ready"
                    and (fabric is None or r["fabric"] == fabric)]

        def wait(condition, timeout: float, what: str) -> None:
            end = time.monotonic() + timeout
            while not condition():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < end, f"{what}:\n{json.dumps(replicas(), indent=1)[:4000]}"
                time.sleep(1)

        wait(lambda: len(ready("llama-70b-sim")) == 2 and len(ready("qwen-7b-sim")) == 2, 120, "the catalog ready")
        # The openai snippet exactly as printed: the demo's own .venv/bin/python has the client.
        key = re.search(r"export LLMGW_KEY=(\S+)", printed)[1]
        snippet = _block(printed, ".venv/bin/python - <<'PY'", "PY")
        wait(lambda: subprocess.run(["bash", "-c", snippet], cwd=tmp_path, env=dict(env, LLMGW_KEY=key),
                                    capture_output=True, timeout=60).returncode == 0, 30, "the gateway to route")
        said = subprocess.run(["bash", "-c", snippet], cwd=tmp_path, env=dict(env, LLMGW_KEY=key),
                              capture_output=True, text=True, timeout=60)
        assert said.returncode == 0 and "qwen-7b-sim" in said.stdout, said.stderr
        # The README's other key, made as it says, works at once with the printed curl line.
        readme = (REPO / "README.md").read_text()
        made = run(re.search(r"`(\.venv/bin/llmgw ctl keys create \S+ -q)`", readme)[1]).strip()
        curl = subprocess.run(["bash", "-c", _block(printed, "curl ", "-d ")], cwd=tmp_path,
                              env=dict(env, LLMGW_KEY=made), capture_output=True, text=True, timeout=60)
        assert curl.returncode == 0 and "[DONE]" in curl.stdout, (curl.stdout, curl.stderr)
        nodes_table = run(steps[0])
        assert all(name in nodes_table for name in ("node01", "node02", "node03", "node04"))
        assert "ready" in nodes_table
        run(steps[1])
        run(steps[2])
        # No Redis here: the agent API's readings reach the web process through the database.
        wait(lambda: all(g["read_at"] is not None and g["util"] is not None and g["temp_c"] is not None
                         for g in as_json(".venv/bin/llmgw ctl gpus")), 60, "every GPU's readings in ctl gpus")
        assert _sqlite_count(db, "SELECT COUNT(*) FROM nodes_gpureadings") == 4

        assert "killed node02" in run(steps[3])
        grace = float(re.search(r"After (\d+) s without a heartbeat", printed)[1])
        assert grace == 15
        node02 = lambda: next(n for n in as_json(".venv/bin/llmgw ctl nodes") if n["name"] == "node02")  # noqa: E731
        wait(lambda: node02()["status"] == "lost", grace + 30, "node02 declared lost after the grace")
        wait(lambda: len(ready("llama-70b-sim", "ib-b")) == 2, 90, "the llama replacement ready on ib-b")
        events = json.dumps(as_json(".venv/bin/llmgw ctl events --limit 200"))
        assert "moving qwen-7b-sim replica" in events and "from node03 to node01" in events
        qwen_nodes = sorted(m["node"] for r in ready("qwen-7b-sim") for m in r["members"])
        assert qwen_nodes == ["node01", "node01"]  # the 1-GPU replica moved out of the way

        assert "revived node02" in run(steps[4])
        wait(lambda: node02()["status"] == "ready", 60, "node02 back")

        def gpu0() -> dict:
            return next(g for g in as_json(".venv/bin/llmgw ctl gpus --node node01") if g["index"] == 0)

        assert "Xid 79" in run(steps[5])
        wait(lambda: gpu0()["health"] == "quarantined", 60, "GPU 0 of node01 quarantined")
        wait(lambda: len(ready("qwen-7b-sim")) == 2 and not [
            r for r in ready("qwen-7b-sim") for m in r["members"] if m["node"] == "node01" and 0 in m["gpus"]],
            90, "no replica on the quarantined GPU, every one ready")
        assert "reset" in run(steps[6])

        def cleared() -> bool:
            done = subprocess.run(["bash", "-c", f"{export}\n{steps[7]}"], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=60)
            return done.returncode == 0 and "back in service" in done.stdout

        wait(cleared, 60, "GPU 0 of node01 cleared by the operator")
        assert gpu0()["health"] != "quarantined"

        drained = run(steps[8], timeout=400)
        assert "done" in drained, drained
        assert not [m for r in replicas() if r["status"] in ("scheduled", "starting", "ready")
                    for m in r["members"] if m["node"] == "node03"]
        assert len(ready("llama-70b-sim", "ib-a")) >= 1 and len(ready("qwen-7b-sim")) == 2
        failed_before = _sqlite_count(db, "SELECT COUNT(*) FROM nodes_event WHERE message LIKE '%-> failed%'")
        below = descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
    said = log.read_text()
    assert "llmgw demo: stopping the control plane, then the simulated nodes" in said
    assert said.rstrip().endswith("llmgw demo: stopped")
    # The control plane stopped first: nothing was failed over while the nodes went.
    assert _sqlite_count(db, "SELECT COUNT(*) FROM nodes_event WHERE message LIKE '%-> failed%'") == failed_before
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/proc/{pid}") and _not_zombie(pid) for pid in below):
        assert time.monotonic() < deadline, "processes of the demo outlived it"
        time.sleep(0.2)
