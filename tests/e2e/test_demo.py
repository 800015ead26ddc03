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
        # The snippet's "python" is the one with the openai package: ours.
        script = _block(printed, "python - <<'PY'", "PY").replace("python - <<'PY'", f"{sys.executable} - <<'PY'", 1)
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
