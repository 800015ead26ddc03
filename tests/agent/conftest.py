"""Fixtures for the node agent: simulated node kits, real agent processes,
a fake control plane that can hand out members, and clean-up of engines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent.engine_process import RECORD_FILE
from agent.proc import ProcessIdentity, signal_group
from agent.simkit import node_kit
from cli.wait import wait_until
from tests.conftest import REPO, free_port

from .fake_control_plane import FakeControlPlane


# --- sockets of a process ---------------------------------------------------------------------


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening_ports(pid: int) -> set[int]:
    """TCP ports the process listens on: its socket inodes matched against the
    kernel's LISTEN entries (state 0A) in /proc/net/tcp and tcp6."""
    inodes = _socket_inodes(pid)
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# --- simulated nodes ------------------------------------------------------------------------


def write_yaml(path: Path, **overrides) -> None:
    """Apply ``section={key: value}`` or ``key=value`` overrides to an agent.yaml."""
    data = yaml.safe_load(path.read_text())
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


FAST = {
    "heartbeat_interval": "1s",
    "reconnect_base": "200ms",
    "reconnect_max": "1s",
    "supervisor": {"health_interval": "200ms", "stop_timeout": "3s"},
}


@pytest.fixture
def sim_node(tmp_path, client_cert):
    """make(node_id, server=..., gpus=2, fabrics=[...], cert_for=None, **overrides) -> agent.yaml path.

    ``cert_for`` gives the node the certificate of another node id."""

    def make(node_id: str, *, server: str, gpus: int = 2, fabrics: list[str] | None = None,
             addr: str = "127.0.1.1", cert_for: str | None = None, **overrides) -> Path:
        cert, key, ca = client_cert(cert_for or node_id)
        paths = node_kit(node_id=node_id, directory=tmp_path / "nodes" / node_id, gpus=gpus,
                         fabric_specs=fabrics or [], addr=addr, server=server, certs=Path(cert).parent)
        settings = {**FAST, **overrides}
        if cert_for:
            settings["tls"] = {"ca": ca, "cert": cert, "key": key}
        write_yaml(paths["config"], **settings)
        return paths["config"]

    return make


# --- agent processes ------------------------------------------------------------------------------


class AgentProcess:
    def __init__(self, config: Path, log_path: Path) -> None:
        self.config = config
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> "AgentProcess":
        handle = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "agent", "--config", str(self.config)],
            cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )
        handle.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for_log(self, text: str, timeout: float = 20.0, *, count: int = 1) -> str:
        def seen():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"agent exited with {self.proc.returncode}:\n{self.log()}")
            return self.log().count(text) >= count

        try:
            wait_until(seen, timeout, interval=0.1, message=f"log line {text!r}")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; agent log:\n{self.log()}") from None
        return self.log()

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signum)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture
def agent_factory(tmp_path):
    agents: list[AgentProcess] = []

    def make(config: Path) -> AgentProcess:
        agent = AgentProcess(config, tmp_path / f"agent-{len(agents)}.log")
        agents.append(agent)
        return agent.start()

    yield make
    for agent in agents:
        agent.stop(signal.SIGKILL)


@pytest.fixture(autouse=True)
def reap_engines(tmp_path):
    """Engines outlive agents by design; a test must not leave them behind."""
    yield
    for record in tmp_path.rglob(RECORD_FILE):
        try:
            data = json.loads(record.read_text())
            if data.get("pid"):
                signal_group(ProcessIdentity(data["pid"], data["start_time"], data["boot_id"]), signal.SIGKILL)
        except (OSError, ValueError, KeyError, TypeError):
            pass


# --- the fake control plane -------------------------------------------------------------------------


@pytest.fixture
def fake_control_plane(pki_dir):
    from pki.services import CA_CERT, SERVER_CERT, SERVER_KEY

    planes: list[FakeControlPlane] = []

    def make(*, port: int | None = None, heartbeat_interval: float = 30.0, desired=None,
             extra: dict | None = None) -> FakeControlPlane:
        plane = FakeControlPlane(
            certfile=str(pki_dir / SERVER_CERT), keyfile=str(pki_dir / SERVER_KEY), cafile=str(pki_dir / CA_CERT),
            port=port or free_port(), heartbeat_interval=heartbeat_interval, extra=extra,
        )
        plane.desired.update(desired or {})
        planes.append(plane)
        return plane.start()

    yield make
    for plane in planes:
        plane.stop()


def sim_member(member: str, *, http_port: int, model: str = "sim-model", rank: int = 0, nnodes: int = 1,
               rendezvous: str = "", fabric: str = "", host: str = "127.0.0.1", gpus=(0,), replica: str = "r1"):
    from agent.protocol import DesiredMember

    argv = ["{python}", "-m", "agent.engines.sim", "--rank", str(rank), "--nnodes", str(nnodes),
            "--host", host, "--port", str(http_port), "--model", model, "--fabric", fabric,
            "--token-delay", "0.001"]
    if rendezvous:
        argv += ["--rendezvous", rendezvous]
    serves = rank == 0
    return DesiredMember(
        member=member, replica=replica, model=model, rank=rank, engine="sim", argv=argv, env={},
        gpus=list(gpus), ports={"http": http_port} if serves else {}, serves_http=serves,
        health_url=f"http://{host}:{http_port}/health" if serves else None,
    )
