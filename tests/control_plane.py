"""Helpers for tests that run the control plane's Celery side for real.

A worker and beat are real processes on the test's Redis (the broker) and the
test database; heartbeats come from a thread with a node's real certificate,
over mTLS, against a real agent API listener. Import the ``celery_factory``
fixture into the test module that needs it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from agent.protocol import example_heartbeat
from cli.wait import wait_until  # noqa: F401 - tests import it from here with the helpers
from tests.conftest import REPO, celery_argv, kill_group, mtls_client, server_env


def redis_url() -> str:
    """The Redis the test process uses; the worker, beat and agent API share it."""
    url = settings.LLMGW_REDIS_URL
    if not url.startswith("redis"):
        pytest.fail(
            "these tests need Redis: run them with 'make test', or set CELERY_BROKER_URL and "
            "LLMGW_REDIS_URL to redis://127.0.0.1:6379/15"
        )
    return url


def control_plane_env(*, grace: float, sweep: float = 1.0) -> dict[str, str]:
    """Settings shared by every process of a fast-clock control plane."""
    url = redis_url()
    return {
        "LLMGW_NODE_GRACE": str(grace),
        # A grace shorter than two heartbeat intervals is refused at start.
        "LLMGW_HEARTBEAT_INTERVAL": str(min(5.0, grace / 3)),
        "LLMGW_SWEEP_INTERVAL": str(sweep),
        "CELERY_BROKER_URL": url,
        "LLMGW_REDIS_URL": url,
    }


@dataclass
class CeleryProcess:
    kind: str  # "worker" or "beat"
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    terminated: bool = False

    def start(self) -> "CeleryProcess":
        handle = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        handle.close()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """A worker says "ready." once it consumes; beat has no such line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"celery {self.kind} exited with {self.proc.returncode}:\n{self.log()}")
            if self.kind != "worker" or " ready." in self.log():
                return
            time.sleep(0.1)
        raise TimeoutError(f"celery {self.kind} not ready after {timeout}s:\n{self.log()}")

    def terminate(self) -> None:
        """SIGTERM, once: a second one may cut a warm shutdown short."""
        if self.proc is not None and not self.terminated:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kill_group(self.proc.pid)
                self.proc.wait()
        kill_group(self.proc.pid)  # anything it started, also when a test killed it

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
def celery_factory(pki_dir, transactional_db, tmp_path):
    """start(kind, **env) -> a running Celery worker or beat against the test database.

    Depends on ``transactional_db`` so that its processes are stopped before
    the database is flushed.
    """
    procs: list[CeleryProcess] = []

    def start(kind: str, **env: str) -> CeleryProcess:
        argv = celery_argv(kind)
        n = len(procs)
        if kind == "beat":
            # Beat keeps its schedule in a file; the default one is not ours to write.
            argv += ["--schedule", str(tmp_path / f"beat-schedule-{n}")]
        else:
            argv += ["--hostname", f"test-worker-{os.getpid()}-{n}@%h"]
        proc = CeleryProcess(kind, argv, server_env(**env), tmp_path / f"celery-{kind}-{n}.log")
        procs.append(proc)
        return proc.start()

    yield start
    # All at once: a worker's warm shutdown and beat's take seconds each.
    for proc in procs:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.terminate()
    for proc in procs:
        proc.stop()


def heartbeat_payload(node_id: str, *, gpus: int = 2, discovery_errors: list[str] | None = None) -> dict:
    """A realistic heartbeat whose GPU uuids belong to this node alone."""
    beat = example_heartbeat(gpus=gpus).to_dict()
    tag = node_id.encode().hex()[-12:].rjust(12, "0")
    for gpu in beat["gpus"]:
        gpu["uuid"] = f"GPU-{gpu['index']:08x}-0000-0000-0000-{tag}"
    beat["discovery_errors"] = list(discovery_errors or [])
    return beat


def heartbeat_once(agent_url: str, node_id: str, certs: tuple[str, str, str], **payload) -> httpx.Response:
    with mtls_client(*certs, timeout=10) as client:
        return client.post(f"{agent_url}/agent/v1/nodes/{node_id}/heartbeat", json=heartbeat_payload(node_id, **payload))


@dataclass
class Heartbeater:
    """A node's heartbeat loop in a thread, as an agent would run it: it keeps
    trying every ``interval`` seconds whatever the control plane does."""

    agent_url: str
    node_id: str
    certs: tuple[str, str, str]
    interval: float = 0.5
    ok: int = 0
    failed: int = 0
    statuses: list[str] = field(default_factory=list)
    last_ok_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "Heartbeater":
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.node_id}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        payload = heartbeat_payload(self.node_id)
        url = f"{self.agent_url}/agent/v1/nodes/{self.node_id}/heartbeat"
        client = None
        while not self._stop.is_set():
            try:
                if client is None:
                    client = mtls_client(*self.certs, timeout=httpx.Timeout(3.0))
                response = client.post(url, json=payload)
                if response.status_code == 200:
                    self.ok += 1
                    self.last_ok_at = time.time()
                    self.statuses.append(response.json()["status"])
                else:
                    self.failed += 1
            except httpx.HTTPError:
                # The control plane is away: start a fresh connection next time.
                self.failed += 1
                if client is not None:
                    client.close()
                client = None
            self._stop.wait(self.interval)
        if client is not None:
            client.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


@pytest.fixture
def heartbeaters():
    """Heartbeat threads that are stopped when the test ends, whatever happens."""
    started: list[Heartbeater] = []

    def start(*args, **kwargs) -> Heartbeater:
        beater = Heartbeater(*args, **kwargs).start()
        started.append(beater)
        return beater

    yield start
    for beater in started:
        beater.stop()




# --- "no node was declared lost" means something only after a sweep could have -----


def blame_deadlines(env: dict[str, str]) -> tuple[float, float]:
    """(grace, post-outage grace) of a control plane started with ``env``,
    computed as its sweep computes them (nodes.clock)."""
    from django.test import override_settings

    from nodes.clock import post_outage_grace

    timings = {
        "LLMGW_NODE_GRACE": float(env["LLMGW_NODE_GRACE"]),
        "LLMGW_HEARTBEAT_INTERVAL": float(env["LLMGW_HEARTBEAT_INTERVAL"]),
        "LLMGW_AGENT_RECONNECT_MAX": float(env.get("LLMGW_AGENT_RECONNECT_MAX", "0")),
    }
    with override_settings(**timings):
        return timings["LLMGW_NODE_GRACE"], post_outage_grace()


def clock_of_this_database() -> tuple[float | None, float | None, bool]:
    """(last sweep, heard since, holding failovers) from the ControlPlaneClock row."""
    from nodes.models import ControlPlaneClock

    row = ControlPlaneClock.objects.filter(pk=1).values_list("last_sweep_at", "heard_since", "holding_since").first()
    if row is None:
        return None, None, False
    last, heard, holding = row
    return (last.timestamp() if last else None, heard.timestamp() if heard else None, holding is not None)


def wait_for_a_sweep_that_could_blame(env: dict[str, str], *, silent_since: float, timeout: float = 60.0,
                                      clock=clock_of_this_database) -> None:
    """Wait until the lost-node sweep has run at a moment when it would have
    declared lost a node unheard since ``silent_since`` (epoch seconds): past
    its grace, past the fresh grace the control plane gives every node after
    its own outage, and not holding failovers (nodes.sweep's own test). Only
    then does "no node was declared lost" say that none was silent."""
    grace, after_outage = blame_deadlines(env)

    def could_blame() -> bool:
        last, heard, holding = clock()
        return bool(last and heard and not holding and last - silent_since > grace and last - heard > after_outage)

    wait_until(could_blame, timeout=timeout,
               message=f"a sweep that would declare lost a node silent since {silent_since:.1f}")
