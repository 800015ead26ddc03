"""The agent's GPU telemetry over the fake NVML of a simulated node, and nvidia-smi's fallback."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from agent.config import AgentConfig, DiscoveryConfig, SupervisorConfig, TelemetryConfig, TlsConfig
from agent.nvml import TelemetryReader, parse_smi_telemetry
from agent.nvml_fake import FakeNvml, inject_fault, write_gpus


def _config(tmp_path: Path, *, gpus: int = 4, source: str = "sim", nvidia_smi: str = "") -> AgentConfig:
    sim = tmp_path / "sim"
    sim.mkdir(exist_ok=True)
    write_gpus(sim, [{"index": i, "uuid": f"GPU-test-{i}", "name": "NVIDIA H200", "memory_mib": 143771,
                      "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0"} for i in range(gpus)])
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return AgentConfig(
        node_id="node01", server="https://127.0.0.1:7443", tls=TlsConfig(Path(), Path(), Path()),
        mgmt_addr="127.0.1.1", discovery=DiscoveryConfig(nvidia_smi=nvidia_smi),
        supervisor=SupervisorConfig(work_dir=work),
        telemetry=TelemetryConfig(source=source, interval=1.0, sim_dir=sim),
    )


def _wait(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_idle_gpus_read_whole_and_real(tmp_path):
    reader = TelemetryReader(_config(tmp_path))
    try:
        block = reader.read()
        assert block.source == "sim" and block.note == ""
        assert [g.index for g in block.gpus] == [0, 1, 2, 3]
        g = block.gpus[0]
        assert g.uuid == "GPU-test-0" and g.util == 0 and g.mem_used_mib == 0 and g.mem_total_mib == 143771
        assert g.power_limit_w == 700.0 and g.power_w == 75.0 and g.temp_c == 31
        assert g.ecc_uncorrected == 0 and g.pending_retirement is False and g.thermal_throttle is False
        assert g.xids == [] and not g.lost and g.error == ""
    finally:
        reader.close()


def test_utilisation_follows_the_engines_load(tmp_path):
    config = _config(tmp_path)
    member = config.supervisor.work_dir / "r1-0"
    member.mkdir()
    import os
    (member / "engine.json").write_text(json.dumps({"pid": os.getpid(), "spec": {"gpus": [1, 2]}}))
    (member / "sim-load.json").write_text(json.dumps({"in_flight": 2}))
    reader = TelemetryReader(config)
    try:
        block = reader.read()
        utils = [g.util for g in block.gpus]
        assert utils == [0, 65, 65, 0]
        assert block.gpus[1].mem_used_mib == int(143771 * 0.9) and block.gpus[1].power_w > 300
    finally:
        reader.close()


def test_an_xid_arrives_through_the_event_api_and_waits_until_sent(tmp_path):
    config = _config(tmp_path)
    heard = []
    reader = TelemetryReader(config, on_xid=lambda: heard.append(1))
    try:
        inject_fault(config.telemetry.sim_dir, {"gpu": 2, "xid": 48})
        _wait(lambda: heard)
        block = reader.read()
        assert block.gpus[2].xids == [48] and block.gpus[2].last_xid == 48
        assert all(g.xids == [] for i, g in enumerate(block.gpus) if i != 2)
        # Not taken by the control plane (a heartbeat failed): it comes again.
        again = reader.read()
        assert again.gpus[2].xids == [48]
        reader.sent(again)
        after = reader.read()
        assert after.gpus[2].xids == [] and after.gpus[2].last_xid == 48
    finally:
        reader.close()


def test_xid_79_loses_the_gpu_and_an_nvml_error_marks_only_its_gpu(tmp_path):
    config = _config(tmp_path)
    reader = TelemetryReader(config)
    try:
        inject_fault(config.telemetry.sim_dir, {"gpu": 0, "xid": 79})
        inject_fault(config.telemetry.sim_dir, {"gpu": 3, "nvml_error": "Unknown Error"})
        block = _wait(lambda: (b := reader.read()).gpus[0].xids and b)
        assert block.gpus[0].lost and block.gpus[0].util is None and block.gpus[0].temp_c is None
        assert "Unknown Error" in block.gpus[3].error and not block.gpus[3].lost
        assert not block.gpus[1].error and not block.gpus[1].lost and block.gpus[1].util == 0
        inject_fault(config.telemetry.sim_dir, {"gpu": 0, "reset": True})
        assert not reader.read().gpus[0].lost
    finally:
        reader.close()


def test_uncorrectable_ecc_counts_and_pending_remap(tmp_path):
    config = _config(tmp_path)
    reader = TelemetryReader(config)
    try:
        inject_fault(config.telemetry.sim_dir, {"gpu": 1, "ecc_uncorrected": 2, "ecc_corrected": 7})
        g = reader.read().gpus[1]
        assert g.ecc_uncorrected == 2 and g.ecc_corrected == 7 and g.pending_retirement is True
    finally:
        reader.close()


def test_a_lost_gpu_stays_lost_across_an_agent_restart(tmp_path):
    config = _config(tmp_path)
    inject_fault(config.telemetry.sim_dir, {"gpu": 1, "lost": True})
    reader = TelemetryReader(config)
    try:
        assert reader.read().gpus[1].lost
    finally:
        reader.close()


def test_without_nvml_it_says_so_and_reads_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncat <<'CSV'\n"
                   "0, GPU-a, 37, 12, 1024, 143771, 44, 123.45, 700.00, 0, 0\n"
                   "1, GPU-b, [N/A], [N/A], 0, 143771, [N/A], [N/A], [N/A], [N/A], [N/A]\n"
                   "CSV\n")
    smi.chmod(0o755)
    config = _config(tmp_path, source="auto", nvidia_smi=str(smi))
    monkeypatch.setattr("agent.nvml.load_pynvml", lambda: (None, "nvidia-ml-py is not installed"))
    reader = TelemetryReader(config)
    block = reader.read()
    assert block.source == "nvidia-smi" and "NVML unavailable: nvidia-ml-py is not installed" in block.note
    assert block.gpus[0].util == 37 and block.gpus[0].power_w == 123.5 and block.gpus[0].ecc_uncorrected == 0
    # What nvidia-smi cannot read is None, never an invented zero.
    b = block.gpus[1]
    assert (b.util, b.temp_c, b.power_w, b.ecc_uncorrected) == (None, None, None, None) and b.mem_used_mib == 0


def test_an_nvidia_smi_that_prints_something_else_quarantines_nothing():
    gpus, problems = parse_smi_telemetry("0, GPU-x, NVIDIA H200, 143771, 00000000:18:00.0\n")
    assert gpus == [] and problems and "does not parse" in problems[0]


def test_the_fake_answers_pynvml_shapes(tmp_path):
    config = _config(tmp_path, gpus=2)
    nv = FakeNvml(config.telemetry.sim_dir)
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 2
    handle = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetPciInfo(handle).busId == "00000000:19:00.0"
    try:
        nv.nvmlEventSetWait_v2(nv.nvmlEventSetCreate(), 10)
    except nv.NVMLError as exc:
        assert exc.value == 10  # NVML_ERROR_TIMEOUT, as pynvml raises it
    else:
        raise AssertionError("an empty event set must time out")


def test_telemetry_config_is_strict(tmp_path):
    from agent.config import _read_telemetry, _Reader

    r = _Reader(tmp_path)
    _read_telemetry(r, {"source": "dcgm", "interval": "0.1s", "sim_dir": str(tmp_path / "nope"), "every": 1})
    text = "\n".join(r.errors)
    assert "telemetry.every: unknown key" in text and "'dcgm' is not one of" in text
    assert "telemetry.interval: must be at least 1s" in text and "is not a directory" in text
    assert replace(TelemetryConfig(), interval=5.0).source == "auto"
