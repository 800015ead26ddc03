"""CPU used by the processes of a benchmark run, read from /proc.

utime + stime of each process (all its threads), sampled before and after a
phase. The machine is shared: what the whole machine spent meanwhile, less
what we can name, is reported as "others", so that a slow run can be told
from a busy neighbour.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int, *, kernel_only: bool = False) -> float | None:
    """utime + stime of a process (all its threads), or stime alone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if kernel_only:
        return int(fields[12]) / CLK_TCK
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _machine_busy() -> float:
    """CPU-seconds the whole machine has spent busy since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / CLK_TCK


@dataclass
class CpuSnapshot:
    at: float
    server: dict[int, float]
    server_kernel: float
    loadgen: float
    redis: float
    postgres: dict[int, float]
    machine: float


@dataclass
class CpuUse:
    seconds: float
    server: float
    server_kernel: float
    loadgen: float
    redis: float
    postgres: float
    machine: float

    @property
    def others(self) -> float:
        return max(0.0, self.machine - self.server - self.loadgen - self.redis - self.postgres)


class CpuMeter:
    def __init__(self, *, server_pids: list[int], redis_pid: int | None, pg_conn, db_name: str) -> None:
        self.server_pids = server_pids
        self.redis_pid = redis_pid
        self.pg_conn = pg_conn
        self.db_name = db_name

    def _pg_pids(self) -> list[int]:
        rows = self.pg_conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", (self.db_name,)
        ).fetchall()
        return [r[0] for r in rows]

    def snapshot(self) -> CpuSnapshot:
        times = os.times()
        return CpuSnapshot(
            at=time.perf_counter(),
            server={pid: _proc_cpu(pid) or 0.0 for pid in self.server_pids},
            server_kernel=sum(_proc_cpu(pid, kernel_only=True) or 0.0 for pid in self.server_pids),
            loadgen=times.user + times.system,
            redis=(_proc_cpu(self.redis_pid) or 0.0) if self.redis_pid else 0.0,
            postgres={pid: _proc_cpu(pid) or 0.0 for pid in self._pg_pids()},
            machine=_machine_busy(),
        )

    def since(self, before: CpuSnapshot) -> CpuUse:
        after = self.snapshot()
        pg = 0.0
        for pid, value in after.postgres.items():
            pg += value - before.postgres.get(pid, 0.0)
        return CpuUse(
            seconds=after.at - before.at,
            server=sum(after.server[p] - before.server[p] for p in self.server_pids),
            server_kernel=after.server_kernel - before.server_kernel,
            loadgen=after.loadgen - before.loadgen,
            redis=after.redis - before.redis,
            postgres=pg,
            machine=after.machine - before.machine,
        )
