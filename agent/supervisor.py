"""Converge this node's engines to the desired state, and watch them.

Level-triggered: ``converge`` is given the whole desired state each time and
starts what is missing, stops what is no longer wanted (SIGTERM to the
group, SIGKILL after ``stop_timeout``), restarts what changed, and leaves the
rest alone. An engine that exits on its own once it has served is not
restarted: it is reported with its exit code, and the control plane decides
(a member of a multi-node replica cannot simply rejoin its group).

An engine that fails at start (exits with a status above 0 before it passed
its health check, or within ``start_window`` of starting when it has none;
not one killed by a signal) is started again after a
delay that doubles each time, from ``restart_backoff`` up to
``restart_backoff_max`` (Kubernetes' CrashLoopBackOff): it is reported as
``backoff`` with its exit code, last lines and restart count meanwhile, and
the control plane fails its replica after a bound (LLMGW_ENGINE_START_ATTEMPTS)
rather than letting it spin.

One thread drives it (``converge`` and ``tick``); ``report`` may be called
from another.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .config import SupervisorConfig
from .engine_process import EngineProcess, check_health, spec_digest
from .engine_user import engine_user_resolve
from .protocol import MEMBER_ID_RE, DesiredState, EngineState

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT = 2.0


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.work_dir = Path(config.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.engine_user = engine_user_resolve(config.engine_user)
        self._engines: dict[str, EngineProcess] = {}
        self._lock = threading.Lock()
        self._refused: set[str] = set()
        self._health_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="health")
        self._adopt()

    def _adopt(self) -> None:
        for directory in sorted(p for p in self.work_dir.iterdir() if p.is_dir()):
            engine = EngineProcess.from_record(directory)
            if engine is not None:
                self._engines[engine.name] = engine

    # --- what is running -------------------------------------------------------------

    def engines(self) -> dict[str, EngineProcess]:
        with self._lock:
            return dict(self._engines)

    def report(self, *, log_bytes_total: int = 160 * 1024, with_logs: bool = True) -> list[EngineState]:
        """Engine states for a heartbeat. Log tails share one byte budget, so
        that eight chatty engines cannot push a heartbeat over the control
        plane's size limit."""
        engines = sorted(self.engines().values(), key=lambda e: e.name)
        per_engine = min(64 * 1024, log_bytes_total // max(1, len(engines))) if with_logs else 0
        return [e.report(self.config.log_lines, per_engine) for e in engines]

    def engines_snapshot(self) -> tuple:
        """What is worth reporting at once about the engines: when it differs
        from the last one sent, the agent reports without waiting."""
        return tuple(
            (e.name, e.pid, e.exited, e.exit_code, e.healthy, e.ever_healthy, e.stopping, e.restarts, e.backing_off)
            for e in sorted(self.engines().values(), key=lambda e: e.name)
        )

    # --- converging ------------------------------------------------------------------

    def converge(self, desired: DesiredState, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        wanted = {}
        for member in desired.members:
            if not MEMBER_ID_RE.match(member.member) or member.member in (".", ".."):
                if member.member not in self._refused:
                    logger.error("desired member %r has a name unfit for a directory; not starting it", member.member)
                    self._refused.add(member.member)
                continue
            wanted[member.member] = member
        with self._lock:
            for name, engine in list(self._engines.items()):
                spec = wanted.get(name)
                if spec is None:
                    if engine.exited:
                        self._drop(name)
                    else:
                        engine.replacement = None
                        engine.begin_stop(self.config.stop_timeout, now)
                elif spec_digest(spec) != engine.spec_digest:
                    if engine.exited:
                        self._drop(name)  # a new spec for an exited member: start it afresh below
                    else:
                        logger.info("engine member=%s: desired spec changed; restarting it", name)
                        engine.replacement = spec
                        engine.begin_stop(self.config.stop_timeout, now)
                elif engine.stopping and engine.replacement is None and not engine.exited:
                    # Wanted again while stopping: let it stop, then start it again.
                    engine.replacement = spec
            for name, spec in wanted.items():
                if name not in self._engines:
                    self._engines[name] = EngineProcess.launch(spec, self.work_dir, user=self.engine_user)

    def _drop(self, name: str) -> None:
        self._engines.pop(name).forget()

    # --- watching --------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """Notice exits, enforce stop deadlines, start replacements, check health."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for name, engine in list(self._engines.items()):
                engine.poll()
                engine.enforce_stop(now)
                if engine.exited and engine.stopping:
                    replacement = engine.replacement
                    self._drop(name)
                    if replacement is not None:
                        self._engines[name] = EngineProcess.launch(replacement, self.work_dir, user=self.engine_user)
                    continue
                if engine.exited:
                    self._crash_loop(name, engine, now)
                    continue
                self._check_health(engine, now)

    def _failed_at_start(self, engine: EngineProcess, now: float) -> bool:
        if engine.adopted or engine.ever_healthy:
            return False  # it served (or we cannot tell): the control plane decides
        if engine.exit_code is None or engine.exit_code <= 0:
            return False  # stopped, or killed by a signal: not a start that failed
        if engine.spec.health_url:
            return True
        return now - engine.started_at < self.config.start_window

    def _crash_loop(self, name: str, engine: EngineProcess, now: float) -> None:
        """Restart an engine that failed at start, after its backoff."""
        if engine.restart_at is None:
            if not self._failed_at_start(engine, now):
                return
            delay = min(self.config.restart_backoff_max, self.config.restart_backoff * 2 ** engine.restarts)
            engine.restart_at = now + delay
            logger.warning("engine member=%s failed at start (exit code %s); restart %d in %.1fs",
                           name, engine.exit_code, engine.restarts + 1, delay)
            return
        if now >= engine.restart_at:
            self._drop(name)
            self._engines[name] = EngineProcess.launch(engine.spec, self.work_dir, user=self.engine_user,
                                                       restarts=engine.restarts + 1)

    def _check_health(self, engine: EngineProcess, now: float) -> None:
        future = engine.health_future
        if future is not None and future.done():
            engine.health_future = None
            healthy = future.result() and not engine.exited
            if healthy != engine.healthy:
                verdict = "healthy" if healthy else "unhealthy"
                logger.info("engine member=%s pid=%s %s", engine.name, engine.pid, verdict)
            engine.healthy = healthy
            engine.ever_healthy = engine.ever_healthy or healthy
        if engine.exited or engine.stopping or not engine.spec.health_url:
            return
        if engine.health_future is None and now >= engine.next_health_at:
            engine.next_health_at = now + self.config.health_interval
            timeout = min(HEALTH_TIMEOUT, self.config.health_interval)
            engine.health_future = self._health_pool.submit(check_health, engine.spec.health_url, timeout)

    def close(self) -> None:
        """Stop watching. The engines keep running: a new agent adopts them."""
        self._health_pool.shutdown(wait=False, cancel_futures=True)
