"""scripts/gpu_check.py: passes on a machine without a GPU by saying so; reads one through nvidia-smi."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def run(*args: str, path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_without_a_gpu_it_says_so_and_passes(tmp_path):
    done = run(path=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "no GPU to check on this machine" in done.stdout and "passed" in done.stdout


def test_it_prints_what_nvidia_smi_reads_and_flags_a_gpu_that_needs_a_reset(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$*\" in\n"
                   "  *utilization*) echo '0, GPU-a, 12, 3, 1000, 143771, 40, 99.5, 700.00, 0, 0';"
                   " echo '1, GPU-b, [GPU requires reset], [N/A], [N/A], [N/A], [N/A], [N/A], [N/A], [N/A], [N/A]';;\n"
                   "  *) echo '0, GPU-a, NVIDIA H200, 143771, 00000000:18:00.0';"
                   " echo '1, GPU-b, NVIDIA H200, 143771, 00000000:19:00.0';;\nesac\n")
    smi.chmod(0o755)
    done = run("--nvidia-smi", str(smi), path=str(tmp_path))
    assert "discovery (nvidia-smi): 2 GPU(s)" in done.stdout
    assert "util=12" in done.stdout and "power_w=99.5" in done.stdout and "ecc_uncorrected=0" in done.stdout
    assert "would quarantine GPU 1" in done.stdout
    assert done.returncode == 1
