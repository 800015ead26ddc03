"""One engine process: started or adopted, watched, stopped, remembered on disk.

Each member lives in ``work_dir/<member>/``: its working directory, its log
(``engine.log``) and its record (``engine.json``: the spec it was started
with, pid, start time, boot id and, once known, its exit code). The record is
what lets a restarted agent adopt the engine instead of starting a second one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .engine_user import EngineUser
from .proc import ProcessIdentity, is_running, process_identity, signal_group, tail_lines
from .protocol import DesiredMember, EngineState, from_dict

logger = logging.getLogger(__name__)

RECORD_FILE = "engine.json"
LOG_FILE = "engine.log"
# The control plane cannot know where Python lives on a node; an argv that
# starts with this runs under the agent's own interpreter (sim engines).
PYTHON_PLACEHOLDER = "{python}"

_no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def spec_digest(spec: DesiredMember) -> str:
    """A digest of everything a member was asked to run: it changes when, and
    only when, the engine must be restarted to follow its desired state."""
    return hashlib.sha256(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode()).hexdigest()


def check_health(url: str, timeout: float) -> bool:
    try:
        with _no_proxy.open(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


ENGINE_WORK = "work"


# A sim engine's cold start (seconds), set in its catalog entry's env: the
# process waits that long, then becomes the engine (the same pid), as a real
# engine spends its first seconds loading weights. For autoscaling's tests
# and benchmark (bench/autoscale.py); real engines ignore it.
SIM_COLD_START = "LLMGW_SIM_COLD_START"
_SLEEP_THEN_EXEC = "import os, sys, time; time.sleep(float(sys.argv[1])); os.execv(sys.argv[2], sys.argv[2:])"


def _sim_cold_start(argv: list[str], env: dict[str, str]) -> list[str]:
    if argv[1:3] != ["-m", "agent.engines.sim"] or not env.get(SIM_COLD_START):
        return argv
    try:
        delay = float(env[SIM_COLD_START])
    except ValueError:
        return argv
    return [sys.executable, "-c", _SLEEP_THEN_EXEC, str(max(0.0, delay)), *argv] if delay > 0 else argv


def _as_user(user: EngineUser, directory: Path, env: dict[str, str]) -> tuple[Path, dict]:
    """The working directory and Popen arguments of an engine run as ``user``.

    The member's directory (its record and log) stays the agent's: an engine
    that could write there could swap the record for a link the root agent
    then writes through. The engine gets ``work/`` inside it, its own."""
    work = directory / ENGINE_WORK
    work.mkdir(exist_ok=True)
    os.chown(work, user.uid, user.gid)
    home = user.home if os.path.isdir(user.home) and os.stat(user.home).st_uid == user.uid else str(work)
    env.update(HOME=home, USER=user.name, LOGNAME=user.name)
    return work, {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}


class EngineProcess:
    def __init__(
        self,
        spec: DesiredMember,
        directory: Path,
        identity: ProcessIdentity | None,
        *,
        popen: subprocess.Popen | None = None,
        adopted: bool = False,
        exit_code: int | None = None,
        exited: bool = False,
    ) -> None:
        self.spec = spec
        self.spec_digest = spec_digest(spec)
        self.directory = directory
        self.identity = identity
        self.popen = popen
        self.adopted = adopted
        self.exit_code = exit_code
        self.exited = exited
        self.healthy = False
        self.ever_healthy = False
        self.stop_deadline: float | None = None
        self.killed = False
        self.replacement: DesiredMember | None = None  # start this once stopped
        self.health_future = None
        self.next_health_at = 0.0
        self.started_at = time.monotonic()
        # Crash-loop backoff (agent.supervisor): restarts so far, and when the
        # next is due while it waits (None: not waiting).
        self.restarts = 0
        self.restart_at: float | None = None

    @property
    def name(self) -> str:
        return self.spec.member

    @property
    def pid(self) -> int | None:
        return self.identity.pid if self.identity else None

    @property
    def stopping(self) -> bool:
        return self.stop_deadline is not None

    # --- starting and adopting -----------------------------------------------------

    @property
    def backing_off(self) -> bool:
        return self.restart_at is not None

    @classmethod
    def launch(cls, spec: DesiredMember, work_dir: Path, *, user: EngineUser | None = None,
               restarts: int = 0) -> "EngineProcess":
        directory = work_dir / spec.member
        directory.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable if i == 0 and a == PYTHON_PLACEHOLDER else a for i, a in enumerate(spec.argv)]
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in spec.env.items()})
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
        argv = _sim_cold_start(argv, env)
        cwd, identity = directory, {}
        if user is not None:
            cwd, identity = _as_user(user, directory, env)
        with open(directory / LOG_FILE, "ab") as log:
            command = shlex.join(argv).replace("\n", "\\n")  # one line in the log, whatever the argv
            log.write(f"--- llmgw-agent {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {command}\n".encode())
            log.flush()
            try:
                # Its own session, so the engine has its own process group (we
                # stop it as a group) and outlives the agent (KillMode=process).
                popen = subprocess.Popen(
                    argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, **identity,
                )
            except OSError as exc:
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                log.write(f"--- llmgw-agent could not start it: {exc}\n".encode())
                engine = cls(spec, directory, None, exit_code=code, exited=True)
                engine.restarts = restarts
                engine.write_record()
                logger.error("engine start failed member=%s replica=%s: %s", spec.member, spec.replica, exc)
                return engine
        identity = process_identity(popen.pid) or ProcessIdentity(popen.pid, -1, "")
        engine = cls(spec, directory, identity, popen=popen)
        engine.restarts = restarts
        engine.write_record()
        logger.info(
            "engine started member=%s replica=%s rank=%d pid=%d gpus=%s",
            spec.member, spec.replica, spec.rank, popen.pid, env["CUDA_VISIBLE_DEVICES"] or "none",
        )
        return engine

    @classmethod
    def from_record(cls, directory: Path) -> "EngineProcess | None":
        """The engine a previous agent started here, adopted if it still runs."""
        try:
            record = json.loads((directory / RECORD_FILE).read_text())
            spec = from_dict(DesiredMember, record["spec"])
            identity = None
            if record.get("pid") is not None:  # None: it never started
                identity = ProcessIdentity(int(record["pid"]), int(record["start_time"]), str(record["boot_id"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("engine record unreadable dir=%s: %s; ignoring it", directory, exc)
            return None
        restarts = record.get("restarts") if isinstance(record.get("restarts"), int) else 0
        if record.get("exited") or identity is None:
            engine = cls(spec, directory, identity, adopted=True, exit_code=record.get("exit_code"), exited=True)
            engine.restarts = restarts
            return engine
        if is_running(identity):
            logger.info("engine adopted member=%s replica=%s pid=%d", spec.member, spec.replica, identity.pid)
            engine = cls(spec, directory, identity, adopted=True)
            engine.restarts = restarts
            return engine
        # Gone while the agent was away, or the pid now belongs to a stranger.
        logger.warning(
            "engine member=%s pid=%d exited while the agent was not running; exit code unknown",
            spec.member, identity.pid,
        )
        engine = cls(spec, directory, identity, adopted=True, exited=True)
        engine.restarts = restarts
        engine.write_record()
        return engine

    def write_record(self) -> None:
        record = {
            "spec": dataclasses.asdict(self.spec),
            "pid": self.identity.pid if self.identity else None,
            "start_time": self.identity.start_time if self.identity else None,
            "boot_id": self.identity.boot_id if self.identity else None,
            "exited": self.exited,
            "exit_code": self.exit_code,
            "restarts": self.restarts,
        }
        tmp = self.directory / (RECORD_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, self.directory / RECORD_FILE)

    def forget(self) -> None:
        """Drop the record (the log stays, for whoever investigates later)."""
        try:
            (self.directory / RECORD_FILE).unlink()
        except FileNotFoundError:
            pass

    # --- watching ------------------------------------------------------------------

    def poll(self) -> bool:
        """True when this call noticed the exit."""
        if self.exited:
            return False
        if self.popen is not None:
            code = self.popen.poll()
            if code is None:
                return False
            self.exit_code = code
        elif self.identity is not None and is_running(self.identity):
            return False
        self.exited = True
        self.healthy = False
        self.write_record()
        level = logging.INFO if self.stopping else logging.WARNING
        logger.log(
            level, "engine exited member=%s replica=%s pid=%s exit_code=%s%s",
            self.name, self.spec.replica, self.pid, self.exit_code, " (stopped)" if self.stopping else "",
        )
        return True

    def report(self, log_lines: int, log_bytes: int) -> EngineState:
        if self.exited and self.backing_off:
            state = "backoff"
        elif self.exited:
            state = "exited"
        elif self.spec.health_url and not self.ever_healthy:
            state = "starting"
        else:
            state = "running"
        return EngineState(
            member=self.name,
            replica=self.spec.replica,
            rank=self.spec.rank,
            state=state,
            pid=self.pid,
            exit_code=self.exit_code,
            healthy=self.healthy and not self.exited,
            log_tail=tail_lines(self.directory / LOG_FILE, log_lines, max_bytes=log_bytes) if log_bytes else [],
            restarts=self.restarts,
        )

    # --- stopping ------------------------------------------------------------------

    def begin_stop(self, timeout: float, now: float) -> None:
        if self.exited or self.stopping:
            return
        self.stop_deadline = now + timeout
        logger.info("engine stopping member=%s pid=%s: SIGTERM to its group", self.name, self.pid)
        if self.identity is None or not signal_group(self.identity, signal.SIGTERM):
            self.poll()

    def enforce_stop(self, now: float) -> None:
        if self.exited or self.killed or self.stop_deadline is None or now < self.stop_deadline:
            return
        logger.warning("engine member=%s pid=%s ignored SIGTERM; SIGKILL to its group", self.name, self.pid)
        self.killed = True
        if self.identity is not None:
            signal_group(self.identity, signal.SIGKILL)
