"""cli.processes: the one supervisor of ``llmgw up``, ``llmgw demo`` and the
simulated cluster, with real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from cli.processes import ProcessGroup, Supervisor, stopped_on_exit
from cli.wait import wait_until

# A child that starts a grandchild in its own process group, prints both pids and waits.
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)
# A child that ignores SIGTERM: only SIGKILL stops it.
STUBBORN = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def group(tmp_path):
    group = ProcessGroup(env=dict(os.environ), log_dir=tmp_path)
    yield group
    group.stop_all(timeout=1)


def test_stop_all_takes_each_childs_own_children_with_it(group, tmp_path):
    parent = group.start("parent", [sys.executable, "-c", PARENT])
    grandchild = int(wait_until(lambda: (tmp_path / "parent.log").read_text().strip(), timeout=20,
                                message="the grandchild's pid"))
    assert os.getpgid(parent.pid) == parent.pid != os.getpgid(0)
    group.stop_all()
    assert parent.poll() is not None
    wait_until(lambda: not running(grandchild), timeout=10, message="the grandchild gone")
    assert group.procs == {}


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout(group, tmp_path):
    stubborn = group.start("stubborn", [sys.executable, "-c", STUBBORN])
    wait_until(lambda: "ready" in (tmp_path / "stubborn.log").read_text(), timeout=20, message="the child ready")
    group.stop_all(timeout=0.5)
    assert stubborn.returncode == -signal.SIGKILL


def test_wait_names_the_child_that_exited(group):
    group.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
    group.start("quitter", [sys.executable, "-c", "raise SystemExit(3)"])
    assert group.wait(interval=0.05) == "quitter"
    assert group.procs["quitter"].returncode == 3
    assert group.procs["sleeper"].poll() is None


def test_sigterm_inside_the_block_stops_the_children_and_restores_the_handlers(group):
    child = group.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
    before = signal.getsignal(signal.SIGTERM)
    with stopped_on_exit(group.stop_all):
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert group.wait(interval=0.05) is None
    assert child.returncode is not None
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_error_during_set_up_stops_what_was_started(group):
    child = group.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
    with pytest.raises(RuntimeError), stopped_on_exit(group.stop_all):
        raise RuntimeError("set-up failed")
    assert child.returncode is not None


SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_a_child_that_dies_is_started_again_while_the_others_keep_running(group):
    """SIGKILL one child: it is started again after the backoff, with a
    message naming it; the other child is never touched."""
    heard = []
    supervisor = Supervisor(group, {"steady": SLEEPER, "victim": SLEEPER}, backoff=0.2,
                            notify=lambda name, message, restarting: heard.append((name, message, restarting)))
    supervisor.start_all()
    steady, victim = group.procs["steady"], group.procs["victim"]
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(lambda: supervisor.check() is None and group.procs["victim"] is not victim
               and group.procs["victim"].poll() is None, timeout=10, message="the victim started again")
    assert heard == [("victim", heard[0][1], True)]
    assert f"victim (pid {victim.pid}) exited with signal SIGKILL" in heard[0][1] and "restart 1" in heard[0][1]
    assert group.procs["steady"] is steady and steady.poll() is None


def test_a_child_that_keeps_dying_at_start_is_given_up_on_by_name(group):
    heard = []
    supervisor = Supervisor(group, {"steady": SLEEPER, "broken": [sys.executable, "-c", "raise SystemExit(3)"]},
                            backoff=0.05, give_up_after=3,
                            notify=lambda name, message, restarting: heard.append((name, message, restarting)))
    supervisor.start_all()
    assert supervisor.run(interval=0.02) == "broken"
    assert [(name, restarting) for name, _, restarting in heard] == [("broken", True), ("broken", True),
                                                                    ("broken", False)]
    assert "broken keeps dying at start (3 times in a row" in heard[-1][1] and "status 3" in heard[-1][1]
    assert group.procs["steady"].poll() is None


def test_a_child_that_ran_a_while_before_dying_is_not_counted_toward_giving_up(group):
    supervisor = Supervisor(group, {"flaky": [sys.executable, "-c", "import time; time.sleep(0.3)"]},
                            backoff=0.01, start_window=0.2, give_up_after=2)
    supervisor.start_all()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert supervisor.check() is None
        time.sleep(0.02)
    assert supervisor.restarts["flaky"] >= 3


def test_the_llmgw_command_loads_no_django_until_a_command_needs_it():
    """``llmgw agent`` runs where only the agent is installed, and ``llmgw ctl``
    talks REST: neither imports Django (cli/env.py)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, cli.main; print(sorted(m for m in sys.modules if m.split('.')[0] in "
                               "('django', 'nodes', 'pki', 'replicas', 'gateway', 'llmgw_site')))"],
        capture_output=True, text=True, timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]"
