"""Child processes started together, watched, and stopped together.

``llmgw up``, ``llmgw demo`` and the simulated cluster all run the control
plane's processes this way. Each child gets a session of its own, so that a
terminal's Ctrl-C reaches only us and we stop the children in order, and so
that a child's own children (gunicorn's workers, an agent's engines) go with
it when its process group is signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def spawn(argv: list[str], *, env: dict[str, str], log: Path | None = None) -> subprocess.Popen:
    """Start ``argv`` in a new session; its output is appended to ``log``, or
    goes where ours goes."""
    if log is None:
        return subprocess.Popen(argv, env=env, start_new_session=True)
    with open(log, "ab") as handle:
        return subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def signal_group(pid: int, signum: int) -> None:
    """Signal a process's whole group, or the process alone when it leads no
    group; one that has already gone is not an error."""
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def stop(procs: list[subprocess.Popen], *, timeout: float = 10.0) -> None:
    """SIGTERM every group at once, then SIGKILL what is still running after ``timeout``."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def stopped_on_exit(stop: Callable[[], None]) -> Iterator[None]:
    """Run ``stop`` when the block is left, whatever happens.

    Inside the block SIGTERM interrupts the main thread as Ctrl-C does, so a
    signal during a long set-up stops the children too (``ProcessGroup.wait``
    turns either into an orderly return). While ``stop`` runs, further signals
    are ignored, so that a second Ctrl-C cannot leave a child behind.
    """
    saved = {signum: signal.signal(signum, signal.default_int_handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum in saved:
            signal.signal(signum, signal.SIG_IGN)
        try:
            stop()
        finally:
            for signum, handler in saved.items():
                signal.signal(signum, handler)


class ProcessGroup:
    """Named children, each in a session of its own; with ``log_dir``, each
    writes to ``<log_dir>/<name>.log``, otherwise where we write."""

    def __init__(self, *, env: dict[str, str], log_dir: Path | None = None) -> None:
        self.env = env
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def log_path(self, name: str) -> Path | None:
        return None if self.log_dir is None else self.log_dir / f"{name}.log"

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        proc = spawn(argv, env=self.env, log=self.log_path(name))
        self.procs[name] = proc
        return proc

    def stop_all(self, *, timeout: float = 10.0) -> None:
        procs, self.procs = list(self.procs.values()), {}
        stop(procs, timeout=timeout)

    def exited(self) -> str | None:
        """The name of a child that has exited, if any has."""
        return next((name for name, proc in self.procs.items() if proc.poll() is not None), None)

    def wait(self, *, interval: float = 0.3) -> str | None:
        """Until Ctrl-C or SIGTERM (None) or until a child exits (its name)."""
        try:
            while (name := self.exited()) is None:
                time.sleep(interval)
            return name
        except KeyboardInterrupt:
            return None


def exit_status(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


class Supervisor:
    """Keeps a ``ProcessGroup``'s children running, as systemd's
    ``Restart=on-failure`` or supervisord would: a child that exits is
    started again after a backoff (``backoff`` seconds, doubled for each death
    in a row at start, at most ``backoff_max``) while the others keep
    serving. A child that dies within ``start_window`` seconds of its start
    ``give_up_after`` times in a row is not started again: ``run`` returns
    its name and the caller stops everything. ``notify(name, message,
    restarting)`` hears of every death (a log line, an Event)."""

    def __init__(
        self, group: ProcessGroup, commands: dict[str, list[str]], *,
        notify: Callable[[str, str, bool], None] | None = None,
        backoff: float = 1.0, backoff_max: float = 30.0, start_window: float = 20.0, give_up_after: int = 5,
    ) -> None:
        self.group = group
        self.commands = commands
        self.notify = notify or (lambda name, message, restarting: None)
        self.backoff, self.backoff_max = backoff, backoff_max
        self.start_window, self.give_up_after = start_window, give_up_after
        self.started_at: dict[str, float] = {}
        self.deaths_at_start: dict[str, int] = {}
        self.restarts: dict[str, int] = {}
        self.due: dict[str, float] = {}  # name -> when it is started again
        self.given_up: str | None = None

    def start(self, name: str) -> subprocess.Popen:
        self.started_at[name] = time.monotonic()
        return self.group.start(name, self.commands[name])

    def start_all(self) -> None:
        for name in self.commands:
            self.start(name)

    def check(self) -> str | None:
        """One look: note the children that exited, start those whose
        backoff is over. Returns the name of a child given up on."""
        now = time.monotonic()
        for name, proc in list(self.group.procs.items()):
            if name in self.due or proc.poll() is None:
                continue
            ran = now - self.started_at[name]
            at_start = ran < self.start_window
            deaths = self.deaths_at_start.get(name, 0) + 1 if at_start else 0
            self.deaths_at_start[name] = deaths
            status = exit_status(proc.returncode)
            if deaths >= self.give_up_after:
                self.given_up = name
                self.notify(name, f"{name} keeps dying at start ({deaths} times in a row, each within "
                            f"{self.start_window:.0f}s of starting; last: {status}); giving up on it", False)
                return name
            delay = min(self.backoff * 2 ** max(deaths - 1, 0), self.backoff_max)
            self.restarts[name] = self.restarts.get(name, 0) + 1
            self.due[name] = now + delay
            self.notify(name, f"{name} (pid {proc.pid}) exited with {status} after {ran:.1f}s; starting it again "
                        f"in {delay:.0f}s (restart {self.restarts[name]})", True)
        for name, due in list(self.due.items()):
            if now >= due:
                del self.due[name]
                self.start(name)
        return None

    def run(self, *, interval: float = 0.3) -> str | None:
        """Until Ctrl-C or SIGTERM (None) or until a child is given up on (its name)."""
        try:
            while (name := self.check()) is None:
                time.sleep(interval)
            return name
        except KeyboardInterrupt:
            return None
