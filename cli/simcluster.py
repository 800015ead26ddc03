"""A simulated cluster on one machine: the control plane's processes and one
real agent per node, each on its own loopback address with its own
certificate, fake GPUs and fake HCAs (``llmgw sim node-kit``), running real
sim engines. ``llmgw demo`` and the end-to-end tests use it.

Killing a node kills its agent and its engines; freezing one stops only its
agent (SIGSTOP), as a hung machine would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .processes import ProcessGroup, signal_group, spawn


@dataclass
class SimNode:
    name: str
    addr: str
    gpus: int = 8
    fabric: str | None = None
    hcas: tuple[str, ...] = ("mlx5_0", "mlx5_1")
    dir: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def work_dir(self) -> Path:
        config = yaml.safe_load((self.dir / "agent.yaml").read_text())
        return Path(config["supervisor"]["work_dir"])


SEEDS_NODES = [
    SimNode("node01", "127.0.1.1", fabric="ib-a", hcas=("mlx5_0", "mlx5_1")),
    SimNode("node02", "127.0.1.2", fabric="ib-a", hcas=("mlx5_0", "mlx5_1")),
    SimNode("node03", "127.0.1.3", fabric="ib-b", hcas=("mlx5_2", "mlx5_3")),
    SimNode("node04", "127.0.1.4", fabric="ib-b", hcas=("mlx5_2", "mlx5_3")),
]


@dataclass
class SimCluster:
    base: Path
    env: dict[str, str]
    agent_url: str
    agent_timings: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, SimNode] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The control plane's processes, each logging to <base>/<name>.log.
        self.processes = ProcessGroup(env=self.env, log_dir=self.base)

    # --- nodes ------------------------------------------------------------------

    def add_node(self, node: SimNode, *, issue_cert, server: str | None = None) -> SimNode:
        """``issue_cert(name, out_dir)`` writes NAME.pem, NAME-key.pem and ca.pem;
        ``server`` is the agent API this node talks to (the cluster's by default)."""
        node.dir = self.base / "nodes" / node.name
        node.dir.mkdir(parents=True, exist_ok=True)
        issue_cert(node.name, node.dir)
        argv = [sys.executable, "-m", "cli", "sim", "node-kit", node.name, "--gpus", str(node.gpus),
                "--addr", node.addr, "--server", server or self.agent_url, "--dir", str(node.dir)]
        if node.fabric:
            argv += ["--fabric", f"{node.fabric}:{','.join(node.hcas)}"]
        subprocess.run(argv, env=self.env, check=True, capture_output=True)
        if self.agent_timings:
            path = node.dir / "agent.yaml"
            config = yaml.safe_load(path.read_text())
            for key, value in self.agent_timings.items():
                section, _, name = key.rpartition(".")
                (config[section] if section else config)[name] = value
            path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.nodes[node.name] = node
        return node

    def start_agent(self, name: str) -> subprocess.Popen:
        node = self.nodes[name]
        node.proc = spawn([sys.executable, "-m", "cli", "agent", "--config", str(node.dir / "agent.yaml")],
                          env=self.env, log=node.dir / "agent.log")
        (node.dir / "agent.pid").write_text(str(node.proc.pid))
        return node.proc

    def engine_pids(self, name: str) -> list[int]:
        """Processes running in the node's engine directories."""
        work = str(self.nodes[name].work_dir.resolve())
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                continue
            if cwd.startswith(work + os.sep):
                pids.append(int(entry.name))
        return pids

    def agent_pid(self, name: str) -> int | None:
        """The node's running agent, from its pid file (it may have been
        started by another command, ``llmgw demo revive``), or None."""
        node = self.nodes[name]
        try:
            pid = int((node.dir / "agent.pid").read_text())
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as handle:
                zombie = handle.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, ValueError):
            return None
        # A recycled pid is not our agent: it must be running this node's config.
        return None if zombie or str(node.dir / "agent.yaml").encode() not in argv else pid

    def kill_node(self, name: str) -> list[int]:
        """The machine dies: its agent and every engine it ran."""
        node = self.nodes[name]
        killed = []
        if node.proc is not None and node.proc.poll() is None:
            signal_group(node.proc.pid, signal.SIGKILL)
            node.proc.wait()
            killed.append(node.proc.pid)
        pid = self.agent_pid(name)
        if pid is not None and pid not in killed:
            signal_group(pid, signal.SIGKILL)
            killed.append(pid)
        for pid in self.engine_pids(name):
            signal_group(pid, signal.SIGKILL)
            killed.append(pid)
        return killed

    def freeze_agent(self, name: str) -> None:
        os.kill(self.nodes[name].proc.pid, signal.SIGSTOP)

    def thaw_agent(self, name: str) -> None:
        os.kill(self.nodes[name].proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """The control plane first, so that it does not fail replicas over
        while the nodes shut down; then the nodes."""
        self.processes.stop_all()
        for name in list(self.nodes):
            node = self.nodes[name]
            if node.proc is not None and node.proc.poll() is None:
                try:
                    os.kill(node.proc.pid, signal.SIGCONT)
                except OSError:
                    pass
            self.kill_node(name)
