"""``llmgw sim node-kit`` and ``llmgw agent --check``: a simulated node in one command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.django_db


def llmgw(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_node_kit_writes_a_node_the_agent_accepts(tmp_path, client_cert):
    cert, _, _ = client_cert("node03")
    certs = str(tmp_path / "certs" / "node03")
    done = llmgw("sim", "node-kit", "node03", "--gpus", "4", "--fabric", "ib-b:mlx5_2,mlx5_3", "--fabric", "ib-c",
                 "--addr", "127.0.1.3", "--server", "https://127.0.0.1:7443", "--dir", str(tmp_path / "kit"),
                 "--certs", certs)
    assert done.returncode == 0, done.stderr
    assert "then: llmgw agent --config" in done.stdout and "issue-client" not in done.stdout

    config = yaml.safe_load((tmp_path / "kit" / "agent.yaml").read_text())
    assert config["node_id"] == "node03" and config["mgmt_addr"] == "127.0.1.3"
    assert config["fabrics"] == [{"name": "ib-b", "hcas": ["mlx5_2", "mlx5_3"]},
                                 {"name": "ib-c", "hcas": ["mlx5_4", "mlx5_5"]}]
    assert config["tls"] == {"ca": f"{certs}/ca.pem", "cert": cert, "key": f"{certs}/node03-key.pem"}

    check = llmgw("agent", "--config", str(tmp_path / "kit" / "agent.yaml"), "--check")
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert len(report["gpus"]) == 4 and report["discovery_errors"] == []
    assert [(h["name"], h["fabric"], h["state"]) for h in report["hcas"]] == [
        ("mlx5_2", "ib-b", "ACTIVE"), ("mlx5_3", "ib-b", "ACTIVE"), ("mlx5_4", "ib-c", "ACTIVE"),
        ("mlx5_5", "ib-c", "ACTIVE"),
    ]


def test_node_kit_island_and_refusals(tmp_path):
    done = llmgw("sim", "node-kit", "node09", "--gpus", "1", "--dir", str(tmp_path / "island"))
    assert done.returncode == 0, done.stderr
    assert "llmgw ctl cert issue-client node09 --out" in done.stdout, "says how to get the certificate"
    assert yaml.safe_load((tmp_path / "island" / "agent.yaml").read_text())["fabrics"] == []

    twice = llmgw("sim", "node-kit", "node10", "--fabric", "ib-a:mlx5_0", "--fabric", "ib-b:mlx5_0",
                  "--dir", str(tmp_path / "bad"))
    assert twice.returncode == 2
    assert "HCA mlx5_0 is already in fabric ib-a" in twice.stderr
    bad_id = llmgw("sim", "node-kit", "Node_10", "--dir", str(tmp_path / "bad"))
    assert bad_id.returncode == 2 and "not a valid node id" in bad_id.stderr


def test_node_kit_paths_that_look_like_yaml_stay_paths(tmp_path):
    from agent.simkit import node_kit

    directory = tmp_path / "kit: #1 'quoted' [x]"
    paths = node_kit(node_id="node04", directory=directory, gpus=1, fabric_specs=["ib-a"], server="https://[::1]:7443")
    config = yaml.safe_load(paths["config"].read_text())
    assert config["server"] == "https://[::1]:7443"
    assert config["discovery"]["nvidia_smi"] == str(directory / "nvidia-smi")
    assert config["supervisor"]["work_dir"] == str(directory / "work")
    assert config["tls"]["key"] == str(directory / "node04-key.pem")
    assert config["fabrics"] == [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]}]
