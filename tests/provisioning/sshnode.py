"""A machine to onboard, on this host: a real OpenSSH sshd on a loopback
address and a high port with its own host key, and a "node" that is a
directory tree (its root) with a fake nvidia-smi and a fake InfiniBand sysfs.
There is no systemd here: a ``systemctl`` first on the session's PATH starts
and stops the unit's ExecStart as a plain process, ``journalctl`` shows its
output, and ``update-ca-certificates`` records that it ran.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.simkit import KitFabric, write_nvidia_smi, write_sysfs
from tests.conftest import wait_for_port

SSHD = "/usr/sbin/sshd"
TEST_USER = "llmgw-ssh-test"

SYSTEMCTL = r"""#!/bin/bash
# systemctl for a node without systemd: the unit's ExecStart as a plain process.
units="$LLMGW_TEST_ROOT/etc/systemd/system"; run="$LLMGW_TEST_ROOT/run/fake-systemd"; mkdir -p "$run"
alive() { [ -f "$run/$1.pid" ] && kill -0 "$(cat "$run/$1.pid")" 2>/dev/null; }
start() {
  alive "$1" && return 0
  # ExecStart's words are double-quoted, as systemd reads them; onboarding's
  # paths hold no space, quote, $ or %, so dropping the quotes splits them right.
  exec_start=$(sed -n 's/^ExecStart=//p' "$units/$1.service" | tr -d '"')
  [ -n "$exec_start" ] || { echo "Unit $1.service not found." >&2; return 5; }
  setsid nohup $exec_start >>"$run/$1.log" 2>&1 </dev/null & echo $! >"$run/$1.pid"
}
stop() { alive "$1" && kill "$(cat "$run/$1.pid")"; for _ in $(seq 50); do alive "$1" || break; sleep 0.1; done; rm -f "$run/$1.pid"; }
now=""; args=()
for a in "$@"; do case "$a" in --now) now=1;; --*) ;; *) args+=("$a");; esac; done
cmd="${args[0]}"; unit="${args[1]%.service}"
case "$cmd" in
  daemon-reload) ;;
  enable) touch "$run/$unit.enabled"; [ -n "$now" ] && start "$unit" ;;
  start) start "$unit" ;;
  stop) stop "$unit" ;;
  restart) stop "$unit"; start "$unit" ;;
  is-active) if alive "$unit"; then echo active; else echo inactive; exit 3; fi ;;
  *) echo "fake systemctl: $cmd not supported" >&2; exit 1 ;;
esac
"""

JOURNALCTL = r"""#!/bin/bash
# journalctl -u UNIT -n N: the plain process's output.
unit=""; n=10
while [ $# -gt 0 ]; do case "$1" in -u) unit="${2%.service}"; shift;; -n) n="$2"; shift;; esac; shift; done
tail -n "$n" "$LLMGW_TEST_ROOT/run/fake-systemd/$unit.log" 2>/dev/null
"""

UPDATE_CA = """#!/bin/sh
# Records that the system trust store would have been rebuilt (this host's is left alone).
mkdir -p "$LLMGW_TEST_ROOT/run" && date +%s >> "$LLMGW_TEST_ROOT/run/update-ca-certificates.ran"
"""


@dataclass
class SshNode:
    node_id: str
    host: str
    port: int
    root: Path
    authorized_keys: list[str]
    gpus: int = 4
    fabrics: list[KitFabric] = field(default_factory=list)
    with_nvidia_smi: bool = True
    proc: subprocess.Popen | None = None
    host_key: str = ""

    @property
    def state(self) -> Path:
        # Readable by the unprivileged test account (sshd reads authorized_keys as the user).
        return self.root.parent / f"{self.root.name}-sshd"

    @property
    def nvidia_smi(self) -> Path:
        return self.root / "usr/bin/nvidia-smi"

    @property
    def ib_root(self) -> Path:
        return self.root / "sys/class/infiniband"

    def start(self) -> "SshNode":
        state, bin_dir = self.state, self.state / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name, text in (("systemctl", SYSTEMCTL), ("journalctl", JOURNALCTL), ("update-ca-certificates", UPDATE_CA)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        key = state / "ssh_host_ed25519_key"
        if not key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        self.host_key = " ".join((state / "ssh_host_ed25519_key.pub").read_text().split()[:2])
        (state / "authorized_keys").write_text("".join(k.strip() + "\n" for k in self.authorized_keys))
        for path in (state, bin_dir, state / "authorized_keys"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        self.root.mkdir(parents=True, exist_ok=True)
        if self.with_nvidia_smi:
            self.nvidia_smi.parent.mkdir(parents=True, exist_ok=True)
            write_nvidia_smi(self.nvidia_smi, self.node_id, self.gpus)
        write_sysfs(self.ib_root, self.node_id, self.fabrics)
        config = state / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress {self.host}\nHostKey {key}\nPidFile {state}/sshd.pid\n"
            f"AuthorizedKeysFile {state}/authorized_keys\nStrictModes no\nUsePAM no\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
            f"PermitRootLogin prohibit-password\nAllowUsers root {TEST_USER}\n"
            f"SetEnv PATH={bin_dir}:/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin "
            f"LLMGW_TEST_ROOT={self.root}\n"
            "Subsystem sftp internal-sftp\nLogLevel VERBOSE\nMaxStartups 100:30:200\nMaxSessions 50\n"
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        log = open(state / "sshd.log", "ab")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_for_port(self.host, self.port, proc=self.proc)
        return self

    def agent_pid(self) -> int | None:
        path = self.root / "run/fake-systemd/llmgw-agent.pid"
        try:
            pid = int(path.read_text())
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError):
            return None

    def agent_log(self) -> str:
        path = self.root / "run/fake-systemd/llmgw-agent.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        pid = self.agent_pid()
        if pid:
            os.kill(pid, signal.SIGTERM)
            for _ in range(50):
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)

    def remove(self) -> None:
        """Stop, and remove the node's directory tree (made outside pytest's tmp_path)."""
        self.stop()
        shutil.rmtree(self.root.parent, ignore_errors=True)


def node_root(prefix: str) -> Path:
    """A directory under /tmp that the unprivileged test account can traverse."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    base.chmod(0o755)
    return base / "root"
