"""The small parts of the weights cache (agent.weights): its configuration,
what it accepts from the control plane, the hub's token, a shared bandwidth
cap, and file helpers (sizes, sha256)."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from .protocol import DesiredWeights

PART_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=-]{0,254}$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1024 * 1024
HF_ENDPOINT = "https://huggingface.co"


@dataclass(frozen=True)
class WeightsConfig:
    cache_dir: Path
    budget_bytes: int
    downloads: int = 2
    bandwidth: int = 0  # bytes per second for all downloads together; 0: no cap
    verify_on_start: bool = True
    # A private or gated repository's files need the hub's token: read from
    # this file (the operator places it, as the TLS key) and sent only to
    # hf_endpoint's origin, never to another source or a redirect's target.
    hf_endpoint: str = HF_ENDPOINT
    hf_token_file: Path | None = None


def origin(url: httpx.URL) -> tuple[str, str, int | None]:
    """Scheme, host and port (the scheme's default when none is given)."""
    return url.scheme, url.host, url.port or {"http": 80, "https": 443}.get(url.scheme)


def read_token(path: Path) -> str:
    """The token in ``path`` (one line); OSError when it cannot be read or is empty."""
    token = path.read_text().strip()
    if not token or any(c.isspace() for c in token):
        raise OSError(f"{path} does not hold one token on one line")
    return token


class HubCredentials:
    """An httpx request hook: the hub's token on a request to the hub's
    origin, and no Authorization header on any other. A hook runs for every
    hop of a redirect, so a resolve URL redirected to a CDN (the hub does so
    for LFS files) reaches the CDN without the token, whatever the HTTP
    library's own redirect rules are. The token is read from its file at each
    request to the hub: a rotated token is used without a restart."""

    def __init__(self, endpoint: str, token_file: Path | None) -> None:
        self.hub = origin(httpx.URL(endpoint))
        self.token_file = token_file

    def is_hub(self, url: httpx.URL) -> bool:
        return origin(url) == self.hub

    def __call__(self, request: httpx.Request) -> None:
        if self.token_file is not None and self.is_hub(request.url):
            try:
                token = read_token(self.token_file)
            except OSError as exc:
                detail = f"{self.token_file}: {exc.strerror}" if exc.strerror else str(exc)
                raise OSError(f"cannot read weights.hf_token_file ({detail})") from None
            request.headers["Authorization"] = f"Bearer {token}"
        else:
            request.headers.pop("Authorization", None)


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
