"""Discovery from a fake nvidia-smi, a failing one, a missing one, and a fake sysfs."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import DiscoveryConfig, load_config
from agent.discovery import discover, discover_gpus, discover_hcas, parse_nvidia_smi_csv
from agent.simkit import node_kit

from .conftest import write_yaml

# The certificates of the simulated nodes come from the test authority, in the database.
pytestmark = pytest.mark.django_db


def kit(tmp_path: Path, node: str, **kwargs) -> dict[str, Path]:
    return node_kit(node_id=node, directory=tmp_path / node, **kwargs)


def test_gpus_from_the_fake_nvidia_smi(tmp_path):
    paths = kit(tmp_path, "node01", gpus=8)
    gpus, errors = discover_gpus(DiscoveryConfig(nvidia_smi=str(paths["nvidia_smi"])))
    assert errors == []
    assert [g.index for g in gpus] == list(range(8))
    assert {g.name for g in gpus} == {"NVIDIA H200"} and {g.memory_mib for g in gpus} == {143771}
    assert gpus[0].pci_bus_id == "00000000:18:00.0"
    assert len({g.uuid for g in gpus}) == 8 and all(g.uuid.startswith("GPU-") for g in gpus)

    other, _ = discover_gpus(DiscoveryConfig(nvidia_smi=str(kit(tmp_path, "node02", gpus=8)["nvidia_smi"])))
    again, _ = discover_gpus(DiscoveryConfig(nvidia_smi=str(kit(tmp_path, "node01b", gpus=8)["nvidia_smi"])))
    assert not {g.uuid for g in gpus} & {g.uuid for g in other}, "two simulated nodes must not share GPU uuids"
    assert [g.uuid for g in gpus] != [g.uuid for g in again]


def test_a_failing_nvidia_smi_is_an_error_not_zero_gpus(tmp_path):
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\" >&2\n"
        "exit 9\n"
    )
    script.chmod(0o755)
    gpus, errors = discover_gpus(DiscoveryConfig(nvidia_smi=str(script)))
    assert gpus == []
    assert errors == [
        f"nvidia-smi: {script} exited with status 9: NVIDIA-SMI has failed because it couldn't "
        "communicate with the NVIDIA driver."
    ]


def test_a_missing_nvidia_smi_is_an_error_not_zero_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    gpus, errors = discover_gpus(DiscoveryConfig(nvidia_smi=""))
    assert gpus == []
    assert len(errors) == 1 and errors[0].startswith("nvidia-smi: not found on PATH")
    assert "unknown (not absent)" in errors[0]


def test_skip_gpus_is_silent(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert discover_gpus(DiscoveryConfig(skip_gpus=True)) == ([], [])


def test_nvml_preferred_but_absent_falls_back_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # as if nvidia-ml-py were not installed
    paths = kit(tmp_path, "node01", gpus=2)
    gpus, errors = discover_gpus(DiscoveryConfig(nvidia_smi=str(paths["nvidia_smi"]), prefer_nvml=True))
    assert len(gpus) == 2
    assert errors == ["NVML: prefer_nvml is set but nvidia-ml-py is not installed (pip install nvidia-ml-py); "
                      "fell back to nvidia-smi"]


def test_a_bad_line_costs_that_gpu_only():
    gpus, errors = parse_nvidia_smi_csv(
        "0, GPU-aaaa, NVIDIA H200, 143771, 00000000:18:00.0\n"
        "1, GPU-bbbb, NVIDIA H200, [N/A], 00000000:19:00.0\n"
        "2, GPU-cccc, NVIDIA H100 80GB HBM3, 81559, 00000000:1A:00.0\n"
    )
    assert [g.uuid for g in gpus] == ["GPU-aaaa", "GPU-cccc"]
    assert gpus[1].name == "NVIDIA H100 80GB HBM3" and gpus[1].memory_mib == 81559
    assert errors == ["line 2 does not parse: '1, GPU-bbbb, NVIDIA H200, [N/A], 00000000:19:00.0'"]


def test_hcas_from_the_fake_sysfs_carry_their_fabric(tmp_path):
    paths = kit(tmp_path, "node01", fabric_specs=["ib-a:mlx5_0,mlx5_1", "ib-b"])
    fabric_of = {"mlx5_0": "ib-a", "mlx5_1": "ib-a", "mlx5_2": "ib-b", "mlx5_3": "ib-b"}.get
    hcas, errors = discover_hcas(paths["ib_root"], fabric_of)
    assert errors == []
    assert [(h.name, h.fabric) for h in hcas] == [
        ("mlx5_0", "ib-a"), ("mlx5_1", "ib-a"), ("mlx5_2", "ib-b"), ("mlx5_3", "ib-b"),
    ]
    first = hcas[0]
    assert (first.port, first.state, first.phys_state, first.link_layer, first.rate) == (
        1, "ACTIVE", "LinkUp", "InfiniBand", "400 Gb/sec (4X NDR)",
    )
    assert len(first.guid.split(":")) == 4 and first.gid == "fe80:0000:0000:0000:" + first.guid
    assert len({h.guid for h in hcas}) == 4


def test_an_unconfigured_hca_is_reported_without_a_fabric_and_the_active_port_wins(tmp_path):
    paths = kit(tmp_path, "node01", fabric_specs=["ib-a:mlx5_0"])
    extra = paths["ib_root"] / "mlx5_4"
    for port, state in (("1", "1: DOWN"), ("2", "4: ACTIVE")):
        (extra / "ports" / port / "gids").mkdir(parents=True)
        (extra / "ports" / port / "state").write_text(state + "\n")
        (extra / "ports" / port / "link_layer").write_text("Ethernet\n")
    (extra / "node_guid").write_text("0c42:a103:00ab:cdef\n")
    (paths["ib_root"] / "mlx5_5").mkdir()  # no ports at all
    hcas, errors = discover_hcas(paths["ib_root"], {"mlx5_0": "ib-a"}.get)
    assert [(h.name, h.fabric, h.port, h.state) for h in hcas] == [
        ("mlx5_0", "ib-a", 1, "ACTIVE"), ("mlx5_4", None, 2, "ACTIVE"),
    ]
    assert hcas[1].link_layer == "Ethernet" and hcas[1].guid == "0c42:a103:00ab:cdef"
    assert errors == [f"HCA mlx5_5: no ports under {paths['ib_root'] / 'mlx5_5' / 'ports'}"]


def test_no_infiniband_at_all_is_an_island(tmp_path):
    assert discover_hcas(tmp_path / "absent", lambda _: None) == ([], [])


def test_discover_uses_the_configuration(sim_node):
    config_path = sim_node("node03", server="https://127.0.0.1:7443", gpus=3, fabrics=["ib-b:mlx5_2,mlx5_3"])
    inventory = discover(load_config(config_path))
    assert len(inventory.gpus) == 3 and inventory.errors == []
    assert [(h.name, h.fabric) for h in inventory.hcas] == [("mlx5_2", "ib-b"), ("mlx5_3", "ib-b")]
    write_yaml(config_path, discovery={"skip_gpus": True})
    assert discover(load_config(config_path)).gpus == []
