"""The curl and openai snippets that 'make demo' prints, run for real."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from gateway import snippets


@pytest.fixture
def demo(gateway_web, make_replica, sim_engine, api_key):
    port = sim_engine("demo-model", token_delay=0.002)
    make_replica("demo-model", port)
    key = api_key("demo")  # before the gateway starts: it loads its keys at start-up, then every 0.2 s
    web = gateway_web()
    return web.url, dict(os.environ, LLMGW_KEY=key)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl_snippet(demo):
    url, env = demo
    result = subprocess.run(["bash", "-c", snippets.curl(base_url=url, model="demo-model")], env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert '"content": "This"' in result.stdout and result.stdout.rstrip().endswith("data: [DONE]")


def test_openai_snippet(demo):
    url, env = demo
    result = subprocess.run([sys.executable, "-c", snippets.openai_python(base_url=url, model="demo-model")], env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("This is demo-model answering")


def test_key_command_prints_the_key_alone():
    assert snippets.key_command("demo") == "export LLMGW_KEY=$(llmgw ctl keys create demo -q)"


def test_the_openai_snippet_needs_only_what_the_runtime_installs():
    """The demo runs from the runtime-only .venv of 'make demo': every package
    the printed snippet imports is in requirements.txt, not only in the
    development requirements."""
    import ast
    from pathlib import Path

    tree = ast.parse(snippets.openai_python(base_url="http://127.0.0.1:8000", model="m"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    third_party = imported - set(sys.stdlib_module_names)
    runtime = (Path(__file__).resolve().parents[2] / "requirements.txt").read_text()
    declared = {line.split("==")[0].split("[")[0].strip().lower() for line in runtime.splitlines()
                if line.strip() and not line.startswith("#")}
    assert third_party == {"openai"} and third_party <= declared
