"""The node's weights cache: fetch, verify, hold, evict.

The control plane names, in the desired state, the weights this node should
hold (``DesiredWeights``: a model at a revision with its files, sizes and
sha256, or a path read in place). This cache converges to that list:

- a file is fetched into ``.partial/<model>/<revision>/<name>.part`` with HTTP
  range requests, so a cut link or a restarted agent resumes where it
  stopped; at most ``downloads`` files at once, under an optional shared
  bandwidth cap;
- a file counts only once its size and sha256 match the manifest: then it is
  fsynced and renamed into ``<model>/<revision>/<name>`` (a rename within one
  filesystem is atomic: no half file is ever taken for a whole one). A wrong
  sha256 throws the bytes away and fetches the file again;
- a revision is complete when every file is; a ``.complete`` marker (written
  by rename) records its manifest, and its mtime-touched ``.used`` file its
  last use (least recently used eviction);
- on start, lock and temporary files a crash left are removed, partial files
  of revisions that are complete are dropped, and complete revisions are
  checked again (sizes at once; sha256 in the background when
  ``verify_on_start``): a truncated or corrupt file is fetched again;
- when space is short, the least recently used revisions that are neither
  wanted nor used by a running engine are evicted; never one in use.

Everything the control plane sends is checked again here: model and revision
names and file names are plain path parts, never a way out of the cache.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from .protocol import CachedModel, DesiredWeights, WeightsFile, WeightsReport
from .weights_files import (
    HubCredentials, RateLimiter, WeightsConfig, desired_problem, file_size, present, sha256_of, tree_size,
)

logger = logging.getLogger(__name__)

PARTIAL = ".partial"
COMPLETE = ".complete"
USED = ".used"
ATTEMPTS = 3  # per file and sync: then the error is reported and the next sync tries again
RETRY_PAUSE = 0.2


@dataclass
class _Progress:
    error: str = ""
    rate: float = 0.0
    window: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes fetched) for the rate


class WeightsCache:
    def __init__(self, config: WeightsConfig, *, on_change: Callable[[], None] = lambda: None,
                 client: httpx.Client | None = None) -> None:
        self.config = config
        self.root = Path(config.cache_dir)
        self.partials = self.root / PARTIAL
        self.root.mkdir(parents=True, exist_ok=True)
        self.partials.mkdir(exist_ok=True)
        self.on_change = on_change
        # trust_env: a node's HTTP(S)_PROXY is for fetching weights.
        self.client = client or httpx.Client(follow_redirects=True, trust_env=True,
                                             timeout=httpx.Timeout(30.0, read=60.0))
        self.hub = HubCredentials(config.hf_endpoint, config.hf_token_file)
        self.client.event_hooks["request"].append(self.hub)
        self.limiter = RateLimiter(config.bandwidth)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, config.downloads), thread_name_prefix="weights")
        self._wanted: dict[str, DesiredWeights] = {}
        self._progress: dict[str, _Progress] = {}
        self._inflight: set[tuple[str, str]] = set()
        self._verified: set[str] = set()  # complete revisions whose files were checked since start
        self._checked: set[tuple[str, str, str]] = set()  # (model, revision, file) whose sha256 matched
        self._refused: dict[str, str] = {}
        self.fetched_bytes = 0  # body bytes received, for tests and benchmarks
        self.corrupt_files = 0  # files whose sha256 did not match
        self._closed = False
        self.clean_on_start()

    # --- places ---------------------------------------------------------------------

    def revision_dir(self, model: str, revision: str) -> Path:
        return self.root / model / revision

    def _part(self, w: DesiredWeights, f: WeightsFile) -> Path:
        return self.partials / w.model / w.revision / (f.name + ".part")

    # --- start ----------------------------------------------------------------------

    def clean_on_start(self) -> None:
        """What a crash left: lock and temporary files, partial downloads of
        revisions already complete; complete revisions checked again."""
        removed = 0
        for path in list(self.root.rglob("*")):
            if path.is_file() and (path.name.endswith(".lock") or path.name.endswith(".tmp")):
                path.unlink(missing_ok=True)
                removed += 1
        for model_dir in self._dirs(self.root):
            for rev_dir in self._dirs(model_dir):
                manifest = self._manifest(rev_dir)
                if manifest is None:
                    continue
                stale = self.partials / model_dir.name / rev_dir.name
                if stale.exists():
                    shutil.rmtree(stale, ignore_errors=True)
                bad = [f["name"] for f in manifest["files"] if not self._size_ok(rev_dir / f["name"], f["size"])]
                if bad:
                    self._uncomplete(rev_dir, bad, "truncated or missing")
                elif not self.config.verify_on_start:
                    self._verified.add(f"{model_dir.name}@{rev_dir.name}")
                    self._checked.update((model_dir.name, rev_dir.name, f["name"]) for f in manifest["files"])
        if removed:
            logger.info("weights cache: removed %d lock or temporary file(s) a previous run left", removed)
        if self.config.verify_on_start:
            for model_dir in self._dirs(self.root):
                for rev_dir in self._dirs(model_dir):
                    if self._manifest(rev_dir) is not None:
                        self._pool.submit(self._verify_revision, model_dir.name, rev_dir.name)

    @staticmethod
    def _dirs(path: Path) -> list[Path]:
        try:
            return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return []

    @staticmethod
    def _size_ok(path: Path, size: int) -> bool:
        try:
            return path.stat().st_size == size
        except OSError:
            return False

    def _manifest(self, rev_dir: Path) -> dict | None:
        try:
            data = json.loads((rev_dir / COMPLETE).read_text())
            return data if isinstance(data.get("files"), list) else None
        except (OSError, ValueError, AttributeError):
            return None

    def _uncomplete(self, rev_dir: Path, bad: list[str], why: str) -> None:
        logger.warning("weights cache: %s/%s: %s %s; fetching again when wanted",
                       rev_dir.parent.name, rev_dir.name, ", ".join(bad[:5]), why)
        (rev_dir / COMPLETE).unlink(missing_ok=True)
        for name in bad:
            (rev_dir / name).unlink(missing_ok=True)

    def _verify_revision(self, model: str, revision: str) -> None:
        rev_dir = self.revision_dir(model, revision)
        manifest = self._manifest(rev_dir)
        if manifest is None:
            return
        bad = [f["name"] for f in manifest["files"] if sha256_of(rev_dir / f["name"]) != f["sha256"]]
        with self._lock:
            if bad:
                self.corrupt_files += len(bad)
                self._uncomplete(rev_dir, bad, "do not match their sha256")
            else:
                self._verified.add(f"{model}@{revision}")
            self._checked.update((model, revision, f["name"]) for f in manifest["files"] if f["name"] not in bad)
        self.on_change()
        if bad:
            self.sync()

    # --- converging -----------------------------------------------------------------

    def sync(self, wanted: list[DesiredWeights] | None = None, in_use: set[str] | None = None) -> None:
        """Converge to ``wanted`` (None: the list already held): fetch what is
        missing, make room, drop partial downloads no longer wanted."""
        with self._lock:
            if self._closed:
                return
            if wanted is not None:
                self._wanted = {}
                self._refused = {}
                for w in wanted:
                    problem = desired_problem(w)
                    if problem:
                        self._refused[w.key] = problem
                        logger.error("weights %s refused: %s", w.key, problem)
                    else:
                        self._wanted[w.key] = w
                if in_use is not None:
                    self._in_use = set(in_use)
            in_use = getattr(self, "_in_use", set())
            for key in in_use:
                self.touch(key)
            self._drop_stale_partials()
            for key, w in self._wanted.items():
                progress = self._progress.setdefault(key, _Progress())
                if w.path:
                    progress.error = "" if present(Path(w.path)) else f"{w.path} is not on this node"
                    continue
                if self._manifest(self.revision_dir(w.model, w.revision)) is not None:
                    progress.error = ""
                    continue
                rev_dir = self.revision_dir(w.model, w.revision)
                # A file counts once checked in this run (fetched, or hashed
                # where a previous run left it): never on its size alone.
                todo = [f for f in w.files if (w.model, w.revision, f.name) not in self._checked]
                if not todo:
                    self._mark_complete(w)
                    continue
                absent = [f for f in todo if not self._size_ok(rev_dir / f.name, f.size)]
                need = sum(f.size - self._part_size(w, f) for f in absent)
                if need > self._free() and not self._evict(need, keep=set(self._wanted) | in_use):
                    progress.error = (f"no space: needs {need} more bytes, the cache has {self._free()} free "
                                      f"(budget {self.config.budget_bytes}) and nothing it may evict")
                    continue
                progress.error = ""
                for f in todo:
                    token = (w.model, w.revision, f.name)
                    if token not in self._inflight:
                        self._inflight.add(token)
                        self._pool.submit(self._fetch, w, f)

    def _part_size(self, w: DesiredWeights, f: WeightsFile) -> int:
        try:
            return min(self._part(w, f).stat().st_size, f.size)
        except OSError:
            return 0

    def _drop_stale_partials(self) -> None:
        for model_dir in self._dirs(self.partials):
            for rev_dir in self._dirs(model_dir):
                key = f"{model_dir.name}@{rev_dir.name}"
                if key not in self._wanted and not any(t[:2] == (model_dir.name, rev_dir.name) for t in self._inflight):
                    shutil.rmtree(rev_dir, ignore_errors=True)
            try:
                model_dir.rmdir()
            except OSError:
                pass

    # --- room -----------------------------------------------------------------------

    def used_bytes(self) -> int:
        return tree_size(self.root)

    def _free(self) -> int:
        disk = shutil.disk_usage(self.root).free
        return max(0, min(self.config.budget_bytes - self.used_bytes(), disk))

    def _evict(self, need: int, *, keep: set[str]) -> bool:
        """Remove the least recently used revisions outside ``keep`` until
        ``need`` bytes are free; False when that is not enough."""
        candidates = []
        for model_dir in self._dirs(self.root):
            for rev_dir in self._dirs(model_dir):
                key = f"{model_dir.name}@{rev_dir.name}"
                if key in keep:
                    continue
                used = rev_dir / USED
                when = used.stat().st_mtime if used.exists() else rev_dir.stat().st_mtime
                candidates.append((when, key, rev_dir))
        candidates.sort()
        evictable = sum(tree_size(d) for _, _, d in candidates)
        if need > self._free() + evictable:
            return False
        for _, key, rev_dir in candidates:
            if need <= self._free():
                break
            logger.info("weights cache: evicting %s (least recently used, not in use) to make room", key)
            shutil.rmtree(rev_dir, ignore_errors=True)
            self._verified.discard(key)
            self._checked = {t for t in self._checked if t[:2] != (rev_dir.parent.name, rev_dir.name)}
            try:
                rev_dir.parent.rmdir()
            except OSError:
                pass
        return need <= self._free()

    # --- fetching -------------------------------------------------------------------

    def _fetch(self, w: DesiredWeights, f: WeightsFile) -> None:
        token = (w.model, w.revision, f.name)
        part = self._part(w, f)
        lock = part.with_name(part.name + ".lock")
        final = self.revision_dir(w.model, w.revision) / f.name
        try:
            if self._size_ok(final, f.size):
                if sha256_of(final) == f.sha256:
                    with self._lock:
                        self._checked.add(token)
                    return
                with self._lock:
                    self.corrupt_files += 1
                logger.warning("weights %s: %s on disk does not match its sha256; fetching it again", w.key, f.name)
                final.unlink(missing_ok=True)
            part.parent.mkdir(parents=True, exist_ok=True)
            lock.write_text(str(os.getpid()))
            for attempt in range(ATTEMPTS):
                if self._closed:
                    return
                try:
                    self._download(f, part)
                except (httpx.HTTPError, OSError) as exc:
                    self._set_error(w.key, f"{f.name}: {exc.__class__.__name__}: {exc}")
                    time.sleep(RETRY_PAUSE * (attempt + 1))
                    continue  # resume from what arrived
                if sha256_of(part) == f.sha256:
                    final.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(part, final)
                    with self._lock:
                        self._checked.add(token)
                    self._set_error(w.key, "")
                    break
                with self._lock:
                    self.corrupt_files += 1
                logger.warning("weights %s: %s does not match its sha256; fetching it again", w.key, f.name)
                part.unlink(missing_ok=True)
                self._set_error(w.key, f"{f.name}: sha256 mismatch (fetching again)")
        except Exception as exc:  # noqa: BLE001 - a download thread must report, never die silently
            logger.exception("weights %s: %s failed", w.key, f.name)
            self._set_error(w.key, f"{f.name}: {exc}")
        finally:
            lock.unlink(missing_ok=True)
            with self._lock:
                self._inflight.discard(token)
                done = all((w.model, w.revision, x.name) in self._checked for x in w.files)
                wanted = self._wanted.get(w.key) == w
                if done and wanted and self._manifest(self.revision_dir(w.model, w.revision)) is None:
                    self._mark_complete(w)
            self.on_change()

    def _download(self, f: WeightsFile, part: Path) -> None:
        offset = part.stat().st_size if part.exists() else 0
        if offset > f.size:
            part.unlink()
            offset = 0
        if offset == f.size:
            return
        headers = {"Range": f"bytes={offset}-", "Accept-Encoding": "identity"} if offset else \
            {"Accept-Encoding": "identity"}
        with self.client.stream("GET", f.url, headers=headers) as response:
            if response.status_code == 416:
                part.unlink(missing_ok=True)
                raise OSError(f"the server refused the range from {offset}; starting over")
            if response.status_code not in (200, 206):
                raise OSError(self._refusal(f, response.status_code))
            mode = "ab" if response.status_code == 206 else "wb"
            with open(part, mode) as out:
                for chunk in response.iter_raw():  # as it arrives: a cut link keeps what came
                    self.limiter.take(len(chunk))
                    out.write(chunk)
                    self._count(f, part, len(chunk))
                    if self._closed:
                        raise OSError("the agent is stopping")
                out.flush()
                os.fsync(out.fileno())
        if part.stat().st_size < f.size:
            raise OSError(f"the link ended at {part.stat().st_size} of {f.size} bytes")

    def _refusal(self, f: WeightsFile, status: int) -> str:
        if status not in (401, 403) or not self.hub.is_hub(httpx.URL(f.url)):
            return f"HTTP {status} from the source"
        if self.config.hf_token_file is None:
            return (f"HTTP {status} from the hub: the repository is private or gated; give this agent a token "
                    "that may read it (weights.hf_token_file in agent.yaml)")
        return (f"HTTP {status} from the hub: the token in {self.config.hf_token_file} may not read this "
                "repository (for a gated one, accept its terms with the token's account)")

    def _count(self, f: WeightsFile, part: Path, n: int) -> None:
        key = f"{part.parent.parent.name}@{part.parent.name}"
        now = time.monotonic()
        with self._lock:
            self.fetched_bytes += n
            progress = self._progress.setdefault(key, _Progress())
            progress.window.append((now, n))
            while progress.window and progress.window[0][0] < now - 5.0:
                progress.window.pop(0)
            span = max(0.5, now - progress.window[0][0])
            progress.rate = sum(b for _, b in progress.window) / span

    def _set_error(self, key: str, error: str) -> None:
        with self._lock:
            self._progress.setdefault(key, _Progress()).error = error

    def _mark_complete(self, w: DesiredWeights) -> None:
        rev_dir = self.revision_dir(w.model, w.revision)
        manifest = {"model": w.model, "revision": w.revision,
                    "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in w.files]}
        tmp = rev_dir / (COMPLETE + ".tmp")
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, rev_dir / COMPLETE)
        (rev_dir / USED).touch()
        self._verified.add(w.key)
        progress = self._progress.setdefault(w.key, _Progress())
        progress.rate, progress.window = 0.0, []
        logger.info("weights %s complete (%d files, sha256 checked)", w.key, len(w.files))

    # --- what engines use -------------------------------------------------------------

    def local_path(self, key: str) -> str | None:
        """Where an engine finds these weights, once they are complete and checked."""
        w = self._wanted.get(key)
        if w is None:
            return None
        if w.path:
            return w.path if present(Path(w.path)) else None
        rev_dir = self.revision_dir(w.model, w.revision)
        if key not in self._verified or self._manifest(rev_dir) is None:
            return None
        return str(rev_dir)

    def touch(self, key: str) -> None:
        """An engine uses these weights now (least recently used eviction)."""
        model, _, revision = key.partition("@")
        used = self.revision_dir(model, revision) / USED
        if used.parent.is_dir():
            used.touch()

    def report(self) -> WeightsReport:
        models: dict[str, CachedModel] = {}
        with self._lock:
            for model_dir in self._dirs(self.root):
                for rev_dir in self._dirs(model_dir):
                    key = f"{model_dir.name}@{rev_dir.name}"
                    complete = self._manifest(rev_dir) is not None and key in self._verified
                    size = tree_size(rev_dir, skip_dot=True)
                    models[key] = CachedModel(model=model_dir.name, revision=rev_dir.name, bytes=size,
                                              total=size if complete else 0, complete=complete)
            for key, w in self._wanted.items():
                progress = self._progress.get(key, _Progress())
                entry = models.get(key) or CachedModel(model=w.model, revision=w.revision)
                if w.path:
                    entry.complete = not progress.error and present(Path(w.path))
                else:
                    entry.total = sum(f.size for f in w.files)
                    if not entry.complete:
                        entry.bytes = sum(min(f.size, file_size(self.revision_dir(w.model, w.revision) / f.name)
                                              or self._part_size(w, f)) for f in w.files)
                entry.rate = 0.0 if entry.complete else round(progress.rate, 1)
                entry.error = progress.error
                models[key] = entry
            for key, problem in self._refused.items():
                model, _, revision = key.partition("@")
                models[key] = CachedModel(model=model[:128], revision=revision[:128], error=problem)
            downloads = len(self._inflight)
        used = self.used_bytes()
        return WeightsReport(free_bytes=self._free(), budget_bytes=self.config.budget_bytes, used_bytes=used,
                             downloads=downloads, models=[models[k] for k in sorted(models)])

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()
