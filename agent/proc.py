"""Linux process facts the supervisor relies on, read from /proc.

A pid alone does not identify a process: pids are recycled. A pid together
with its start time (``/proc/<pid>/stat`` field 22, clock ticks since boot)
and the boot id does, which is how an agent restarted hours later tells its
own engine from a stranger that happens to have the same pid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: int
    boot_id: str


def boot_id() -> str:
    try:
        return (PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # Field 2 is the command in parentheses and may itself contain spaces or
    # parentheses; everything after the last ')' splits cleanly.
    _, _, rest = raw.rpartition(")")
    return rest.split()  # rest[0] is field 3 (state), rest[19] is field 22


def process_identity(pid: int) -> ProcessIdentity | None:
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return ProcessIdentity(pid=pid, start_time=int(fields[19]), boot_id=boot_id())


def is_running(identity: ProcessIdentity) -> bool:
    """True if that very process still runs (a zombie has finished running)."""
    fields = _stat_fields(identity.pid)
    if fields is None or len(fields) < 20:
        return False
    if fields[0] in ("Z", "X"):
        # Exited, waiting for a parent that is not us (init may not reap here).
        return False
    return int(fields[19]) == identity.start_time and boot_id() == identity.boot_id


def signal_group(identity: ProcessIdentity, signum: int) -> bool:
    """Signal the process group the engine leads, only if it is still ours."""
    if not is_running(identity):
        return False
    try:
        os.killpg(identity.pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def tail_lines(path: Path, lines: int, *, max_bytes: int = 64 * 1024, max_line: int = 1000) -> list[str]:
    """The last ``lines`` lines of a log, reading only its end."""
    if lines <= 0 or max_bytes <= 0:
        return []
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            start = max(0, size - max_bytes)
            handle.seek(start)
            data = handle.read()
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace")
    result = text.splitlines()
    if start > 0 and result:
        result = result[1:]  # the first line is cut in the middle
    result = [line if len(line) <= max_line else line[:max_line] + "..." for line in result[-lines:]]
    # Truncating long lines can still leave us over budget; drop the oldest.
    total = sum(len(line) + 1 for line in result)
    while result and total > max_bytes:
        total -= len(result.pop(0)) + 1
    return result
