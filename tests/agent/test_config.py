"""agent.yaml: what a good one gives, and what each mistake says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent.config import ConfigError, load_config
from agent.durations import BadDuration, parse_duration
from tests.conftest import REPO

from .conftest import write_yaml

# The certificates of the simulated nodes come from the test authority, in the database.
pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "text, seconds",
    [("5s", 5.0), ("1m", 60.0), ("500ms", 0.5), ("1m30s", 90.0), ("2h", 7200.0), ("1.5s", 1.5), (3, 3.0)],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["5", "five", "5 seconds", "-1s", "", "1d", True])
def test_bad_durations(text):
    with pytest.raises(BadDuration):
        parse_duration(text)


@pytest.fixture
def config_path(sim_node):
    return sim_node("node01", server="https://127.0.0.1:7443", gpus=4, fabrics=["ib-a:mlx5_0,mlx5_1"])


def errors_of(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value.errors


def test_a_node_kit_config_loads(config_path):
    config = load_config(config_path)
    assert config.node_id == "node01"
    assert config.server == "https://127.0.0.1:7443"
    assert config.heartbeat_interval == 1.0
    assert config.reconnect_base == 0.2 and config.reconnect_max == 1.0
    assert [(f.name, f.hcas) for f in config.fabrics] == [("ib-a", ("mlx5_0", "mlx5_1"))]
    assert config.fabric_of("mlx5_1") == "ib-a" and config.fabric_of("mlx5_7") is None
    assert config.supervisor.health_interval == 0.2
    assert config.supervisor.log_lines == 512
    assert config.tls.cert.name == "node01.pem"


def test_unknown_key_names_the_field_and_suggests(config_path):
    write_yaml(config_path, supervisor={"log_line": 100}, heartbeat="5s")
    errors = errors_of(config_path)
    assert any(e.startswith("supervisor.log_line: unknown key; did you mean 'log_lines'?") for e in errors), errors
    assert any(e.startswith("heartbeat: unknown key; did you mean 'heartbeat_interval'?") for e in errors), errors


def test_bad_duration_says_how_to_write_one(config_path):
    write_yaml(config_path, heartbeat_interval="5 seconds", supervisor={"stop_timeout": "0s"})
    errors = errors_of(config_path)
    assert "heartbeat_interval: '5 seconds' is not a duration; write it like 5s, 1m, 500ms or 1m30s" in errors
    assert "supervisor.stop_timeout: must be longer than zero" in errors


def test_missing_certificate_says_where_certificates_come_from(config_path, tmp_path):
    write_yaml(config_path, tls={"cert": str(tmp_path / "nowhere.pem")})
    (error,) = errors_of(config_path)
    assert error.startswith(f"tls.cert: {tmp_path / 'nowhere.pem'} does not exist")
    assert "llmgw ctl cert issue-client NODE --out DIR" in error


def test_key_of_another_certificate_is_refused(config_path, client_cert):
    _, other_key, _ = client_cert("node99")
    write_yaml(config_path, tls={"key": other_key})
    (error,) = errors_of(config_path)
    assert error.startswith("tls.key:") and "issued together" in error


def test_hca_under_two_fabrics_is_refused(config_path):
    write_yaml(config_path, fabrics=[{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]},
                                     {"name": "ib-b", "hcas": ["mlx5_1"]}])
    (error,) = errors_of(config_path)
    assert error.startswith("fabrics[1].hcas: HCA mlx5_1 is listed under two fabrics, ib-a and ib-b")
    assert "hang on their first all-reduce" in error


def test_hca_the_machine_does_not_have_is_refused(config_path):
    write_yaml(config_path, fabrics=[{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_9"]}])
    (error,) = errors_of(config_path)
    assert error.startswith("fabrics: HCA mlx5_9 (fabric ib-a) is not on this machine")
    assert "has mlx5_0, mlx5_1" in error


def test_node_id_must_be_hostname_like(config_path):
    write_yaml(config_path, node_id="Node_01")
    (error,) = errors_of(config_path)
    assert error.startswith("node_id: 'Node_01' is not a valid node id")


def test_server_must_be_https(config_path):
    write_yaml(config_path, server="http://127.0.0.1:7443")
    (error,) = errors_of(config_path)
    assert error.startswith("server: 'http://127.0.0.1:7443' must be the agent API's https URL")


def test_configured_nvidia_smi_must_exist(config_path, tmp_path):
    write_yaml(config_path, discovery={"nvidia_smi": str(tmp_path / "bin" / "nvidia-smi")})
    (error,) = errors_of(config_path)
    assert error.startswith(f"discovery.nvidia_smi: {tmp_path / 'bin' / 'nvidia-smi'} is not an executable file")
    write_yaml(config_path, discovery={"skip_gpus": True})
    assert load_config(config_path).discovery.skip_gpus


def test_every_problem_is_listed_at_once(config_path):
    data = yaml.safe_load(config_path.read_text())
    data.update(node_id="", reconnect_base="1m", reconnect_max="1s", colour="blue")
    del data["tls"]
    config_path.write_text(yaml.safe_dump(data))
    errors = errors_of(config_path)
    fields = [e.split(":", 1)[0] for e in errors]
    assert fields == ["colour", "node_id", "tls", "reconnect_base"], errors


def test_agent_exits_2_with_the_messages(config_path):
    write_yaml(config_path, heartbeat_interval="soon")
    done = subprocess.run(
        [sys.executable, "-m", "cli", "agent", "--config", str(config_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "has 1 problem(s); the agent did not start" in done.stderr
    assert "heartbeat_interval: 'soon' is not a duration" in done.stderr


def test_unreadable_file(tmp_path):
    errors = errors_of(tmp_path / "missing.yaml")
    assert errors[0].startswith("cannot read the configuration")
    (tmp_path / "bad.yaml").write_text("node_id: [unclosed\n")
    assert errors_of(tmp_path / "bad.yaml")[0].startswith("not valid YAML")
