"""'llmgw demo gpu-fail NODE INDEX' and 'llmgw sim gpu-fault': faults reach a simulated node's fake NVML."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent.nvml_fake import FAULTS_FILE, FakeNvml
from agent.simkit import node_kit
from tests.conftest import REPO, server_env

pytestmark = pytest.mark.django_db


def llmgw(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


def test_demo_gpu_fail_raises_xid_79_on_the_nodes_fake_nvml(tmp_path):
    data = tmp_path / "demo"
    node_dir = data / "sim" / "nodes" / "node01"
    node_kit(node_id="node01", directory=node_dir, gpus=4)
    env = server_env(LLMGW_DATA_DIR=str(data))
    done = llmgw("demo", "gpu-fail", "node01", "2", "--data-dir", str(data), env=env)
    assert done.returncode == 0, done.stderr
    assert "Xid 79 raised" in done.stdout
    nv = FakeNvml(node_dir)
    nv.nvmlInit()
    event_set = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(2, 0x8, event_set)
    with pytest.raises(nv.NVMLError):  # fallen off the bus
        nv.nvmlDeviceGetUUID(2)
    assert nv.nvmlDeviceGetUUID(1).startswith("GPU-")
    wrong = llmgw("demo", "gpu-fail", "node01", "9", "--data-dir", str(data), env=env)
    assert wrong.returncode == 1 and "has GPUs 0-3, not 9" in wrong.stderr
    missing = llmgw("demo", "gpu-fail", "node07", "0", "--data-dir", str(data), env=env)
    assert missing.returncode == 1 and "no simulated node node07" in missing.stderr
    assert llmgw("demo", "gpu-fail", "node01", "2", "--reset", "--data-dir", str(data), env=env).returncode == 0


def test_sim_gpu_fault_writes_one_line_and_refuses_what_is_not_a_kit(tmp_path):
    node_kit(node_id="node02", directory=tmp_path / "n2", gpus=2)
    env = server_env()
    done = llmgw("sim", "gpu-fault", "--dir", str(tmp_path / "n2"), "--gpu", "1", "--ecc-uncorrected", "2", env=env)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in (tmp_path / "n2" / FAULTS_FILE).read_text().splitlines()]
    assert [(f["gpu"], f["ecc_uncorrected"]) for f in lines] == [(1, 2)]
    bad = llmgw("sim", "gpu-fault", "--dir", str(tmp_path), "--gpu", "0", "--lost", env=env)
    assert bad.returncode == 2 and "is not a simulated node's kit" in bad.stderr
    out = llmgw("sim", "gpu-fault", "--dir", str(tmp_path / "n2"), "--gpu", "5", "--lost", env=env)
    assert out.returncode == 2 and "this node has GPUs 0-1" in out.stderr
