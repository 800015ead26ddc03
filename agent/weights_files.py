"""The small parts of the weights cache (agent.weights): its configuration,
what it accepts from the control plane, a shared bandwidth cap, and file
helpers (sizes, sha256)."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .protocol import DesiredWeights

PART_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=-]{0,254}$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1024 * 1024


@dataclass(frozen=True)
class WeightsConfig:
    cache_dir: Path
    budget_bytes: int
    downloads: int = 2
    bandwidth: int = 0  # bytes per second for all downloads together; 0: no cap
    verify_on_start: bool = True


def file_problem(name: str) -> str:
    parts = name.split("/") if isinstance(name, str) and name else [""]
    if len(name or "") > 1024 or any(not PART_NAME_RE.match(p) or p in (".", "..") for p in parts):
        return f"{str(name)[:120]!r} is not a relative path of plain parts"
    return ""


def desired_problem(w: DesiredWeights) -> str:
    """Why this node refuses these weights ('' when it takes them)."""
    if not NAME_RE.match(w.model) or not NAME_RE.match(w.revision):
        return f"{w.model[:80]!r}@{w.revision[:80]!r} is not a model and revision of plain names"
    if w.path:
        return "" if w.path.startswith("/") and "\x00" not in w.path else f"{w.path[:120]!r} is not an absolute path"
    names = set()
    for f in w.files:
        if problem := file_problem(f.name):
            return problem
        if f.name in names or f.size < 0 or not SHA256_RE.match(f.sha256) or not f.url.startswith(("http://", "https://")):
            return f"{f.name}: needs a size, a sha256 and an http(s) url, once"
        names.add(f.name)
    return ""


class RateLimiter:
    """One budget of bytes per second shared by every download."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
        delay = start - now
        if delay > 0:
            time.sleep(delay)


def present(path: Path) -> bool:
    try:
        return path.is_file() or (path.is_dir() and any(path.iterdir()))
    except OSError:
        return False


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def tree_size(path: Path, *, skip_dot: bool = False) -> int:
    total = 0
    for p in path.rglob("*"):
        if skip_dot and p.name.startswith("."):
            continue
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(CHUNK):
                digest.update(block)
    except OSError:
        return ""
    return digest.hexdigest()
