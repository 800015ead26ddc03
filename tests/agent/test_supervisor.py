"""The supervisor against real processes: start, watch, stop, adopt.

Until scheduling exists the control plane never asks for members, so these
drive the supervisor directly with a DesiredState.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from agent.config import SupervisorConfig
from agent.engine_process import LOG_FILE, RECORD_FILE
from agent.proc import process_identity
from agent.protocol import DesiredMember, DesiredState
from agent.supervisor import Supervisor
from tests.conftest import free_port

from .conftest import sim_member, wait_until


def python_member(name: str, code: str, **kwargs) -> DesiredMember:
    return DesiredMember(
        member=name, replica="r1", model="m", rank=0, engine="sim", argv=["{python}", "-c", code],
        env=kwargs.pop("env", {}), gpus=kwargs.pop("gpus", [0, 1]), ports={}, serves_http=False, **kwargs,
    )


def settle(supervisor: Supervisor, predicate, timeout: float = 15.0, message: str = "state"):
    def check():
        supervisor.tick()
        return predicate()

    return wait_until(check, timeout, interval=0.05, message=message)


@pytest.fixture
def config(tmp_path):
    return SupervisorConfig(work_dir=tmp_path / "work", log_lines=5, stop_timeout=1.0, health_interval=0.1)


def state_of(supervisor: Supervisor, member: str):
    return next((s for s in supervisor.report() if s.member == member), None)


def test_starts_a_member_in_its_own_directory_group_and_gpus(config):
    supervisor = Supervisor(config)
    code = (
        "import os, sys, time\n"
        "print('gpus', os.environ['CUDA_VISIBLE_DEVICES'], 'cwd', os.getcwd(), 'extra', os.environ['EXTRA'])\n"
        "for i in range(12): print('line', i)\n"
        "sys.stdout.flush(); time.sleep(60)\n"
    )
    member = python_member("m-1", code, gpus=[2, 3], env={"EXTRA": "yes"})
    supervisor.converge(DesiredState(version=1, members=[member]))
    state = settle(supervisor, lambda: (s := state_of(supervisor, "m-1")) and s.log_tail[-1:] == ["line 11"] and s)
    assert state.state == "running" and state.pid and state.exit_code is None
    assert os.getpgid(state.pid) == state.pid, "an engine leads its own process group"
    assert os.getsid(state.pid) == state.pid
    assert state.log_tail == [f"line {i}" for i in range(7, 12)]
    log = (config.work_dir / "m-1" / LOG_FILE).read_text()
    assert f"gpus 2,3 cwd {config.work_dir / 'm-1'} extra yes" in log
    record = json.loads((config.work_dir / "m-1" / RECORD_FILE).read_text())
    assert record["pid"] == state.pid and record["start_time"] == process_identity(state.pid).start_time

    supervisor.converge(DesiredState(version=2))
    settle(supervisor, lambda: state_of(supervisor, "m-1") is None, message="stopped and forgotten")
    assert process_identity(state.pid) is None or _is_zombie(state.pid)
    assert not (config.work_dir / "m-1" / RECORD_FILE).exists()
    assert (config.work_dir / "m-1" / LOG_FILE).exists(), "the log stays for whoever investigates"


def _is_zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def test_an_exit_is_reported_with_its_code_and_not_restarted(config):
    # Past its start window: it served, so its exit is the control plane's to handle.
    supervisor = Supervisor(dataclasses.replace(config, start_window=0.0))
    desired = DesiredState(version=1, members=[python_member("m-1", "print('bye'); raise SystemExit(7)")])
    supervisor.converge(desired)
    state = settle(supervisor, lambda: (s := state_of(supervisor, "m-1")) and s.state == "exited" and s)
    assert state.exit_code == 7 and not state.healthy and "bye" in state.log_tail
    first_pid = state.pid
    for _ in range(5):
        supervisor.converge(desired)
        supervisor.tick()
    assert state_of(supervisor, "m-1").pid == first_pid, "still the exited one: the control plane decides"


def test_a_missing_program_is_an_exit_not_a_crash(config):
    supervisor = Supervisor(config)
    member = python_member("m-1", "")
    member.argv = ["/nonexistent/engine", "--serve"]
    supervisor.converge(DesiredState(version=1, members=[member]))
    state = state_of(supervisor, "m-1")
    assert state.state == "exited" and state.exit_code == 127
    assert "could not start it" in state.log_tail[-1]
    again = state_of(Supervisor(config), "m-1")  # and so it stays, for the next agent
    assert (again.state, again.exit_code, again.pid) == ("exited", 127, None)


def test_sigterm_then_sigkill_after_stop_timeout(config):
    supervisor = Supervisor(config)
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    supervisor.converge(DesiredState(version=1, members=[python_member("m-1", stubborn)]))
    settle(supervisor, lambda: "up" in (state_of(supervisor, "m-1").log_tail or []))
    started = time.monotonic()
    supervisor.converge(DesiredState(version=2))
    supervisor.tick()
    assert state_of(supervisor, "m-1").state == "running", "still there while it ignores SIGTERM"
    settle(supervisor, lambda: state_of(supervisor, "m-1") is None, message="killed")
    assert time.monotonic() - started >= config.stop_timeout


def test_health_checks_make_a_serving_engine_running_and_healthy(config):
    supervisor = Supervisor(config)
    port = free_port()
    supervisor.converge(DesiredState(version=1, members=[sim_member("leader", http_port=port)]))
    assert state_of(supervisor, "leader").state == "starting"
    state = settle(supervisor, lambda: (s := state_of(supervisor, "leader")) and s.healthy and s)
    assert state.state == "running"
    supervisor.converge(DesiredState(version=2))
    settle(supervisor, lambda: not supervisor.report(), message="stopped")


def test_a_changed_spec_restarts_the_member(config):
    supervisor = Supervisor(config)
    supervisor.converge(DesiredState(version=1, members=[python_member("m-1", "import time; time.sleep(60)")]))
    first = state_of(supervisor, "m-1").pid
    supervisor.converge(DesiredState(version=2, members=[python_member("m-1", "import time; time.sleep(61)")]))
    state = settle(supervisor, lambda: (s := state_of(supervisor, "m-1")) and s.pid != first and s)
    assert state.state == "running"
    assert process_identity(first) is None or _is_zombie(first)
    supervisor.converge(DesiredState(version=3))
    settle(supervisor, lambda: not supervisor.report(), message="stopped")
    assert process_identity(state.pid) is None or _is_zombie(state.pid)


def test_a_new_supervisor_adopts_running_engines_instead_of_starting_them_again(config):
    port = free_port()
    members = [sim_member("leader", http_port=port), python_member("w", "import time; time.sleep(60)")]
    desired = DesiredState(version=1, members=members)
    first = Supervisor(config)
    first.converge(desired)
    settle(first, lambda: state_of(first, "leader").healthy)
    pids = {s.member: s.pid for s in first.report()}
    first.close()

    second = Supervisor(config)  # what a restarted agent does
    adopted = second.engines()
    assert {name: e.pid for name, e in adopted.items()} == pids
    assert all(e.adopted and not e.exited for e in adopted.values())
    second.converge(desired)
    state = settle(second, lambda: (s := state_of(second, "leader")) and s.healthy and s)
    assert {s.member: s.pid for s in second.report()} == pids, "same pids: nothing started twice"
    assert state.state == "running"

    # An adopted engine is not our child: its exit is seen through /proc.
    os.kill(pids["w"], 9)
    exited = settle(second, lambda: (s := state_of(second, "w")) and s.state == "exited" and s)
    assert exited.exit_code is None, "the exit code of a process we did not start is unknown"

    second.converge(DesiredState(version=2))
    settle(second, lambda: not second.report(), message="adopted engines stopped")


def test_a_recycled_pid_is_not_adopted(config):
    """A record whose pid now belongs to someone else (here: this test process,
    with another start time) is an engine that exited, never a process to signal."""
    directory = config.work_dir / "old"
    directory.mkdir(parents=True)
    me = process_identity(os.getpid())
    member = python_member("old", "")
    record = {"spec": member.__dict__, "pid": me.pid, "start_time": me.start_time + 1, "boot_id": me.boot_id,
              "exited": False, "exit_code": None}
    (directory / RECORD_FILE).write_text(json.dumps(record))
    supervisor = Supervisor(config)
    engine = supervisor.engines()["old"]
    assert engine.exited and engine.exit_code is None
    supervisor.converge(DesiredState(version=1))  # would SIGTERM it, were it taken for ours
    supervisor.tick()
    assert supervisor.report() == []
    assert process_identity(os.getpid()) is not None


def test_names_unfit_for_a_directory_are_refused(config, caplog):
    supervisor = Supervisor(config)
    member = python_member("../escape", "import time; time.sleep(60)")
    supervisor.converge(DesiredState(version=1, members=[member]))
    assert supervisor.report() == []
    assert "unfit for a directory" in caplog.text
    assert not (config.work_dir.parent / "escape").exists()


def test_log_tail_is_bounded_in_bytes(config):
    chatty_config = SupervisorConfig(work_dir=config.work_dir, log_lines=1000, stop_timeout=1, health_interval=1)
    supervisor = Supervisor(chatty_config)
    code = "import sys, time; [print('x' * 3000) for _ in range(200)]; sys.stdout.flush(); time.sleep(60)"
    supervisor.converge(DesiredState(version=1, members=[python_member("chatty", code)]))
    settle(supervisor, lambda: len(state_of(supervisor, "chatty").log_tail) > 10)
    (state,) = supervisor.report(log_bytes_total=20_000)
    assert sum(len(line) + 1 for line in state.log_tail) <= 20_000
    assert all(len(line) <= 1003 for line in state.log_tail)
    assert supervisor.report(with_logs=False)[0].log_tail == []
    supervisor.converge(DesiredState(version=2))
    settle(supervisor, lambda: not supervisor.report(), message="stopped")



def test_a_failure_at_start_is_restarted_with_exponential_backoff(config):
    """CrashLoopBackOff: 0.2 s, 0.4 s, 0.8 s, capped at 0.8 s; reported as
    backoff with the exit status, the last lines and the restart count."""
    config = dataclasses.replace(config, restart_backoff=0.2, restart_backoff_max=0.8)
    supervisor = Supervisor(config)
    code = "import sys; print('error: unrecognized arguments: --bogus', flush=True); sys.exit(2)"
    desired = DesiredState(version=1, members=[python_member("m-1", code)])
    supervisor.converge(desired)
    starts, seen = [], set()
    deadline = time.monotonic() + 20
    while len(starts) < 5 and time.monotonic() < deadline:
        supervisor.tick()
        engine = supervisor.engines()["m-1"]
        if engine.restarts not in seen:
            seen.add(engine.restarts)
            starts.append(time.monotonic())
        time.sleep(0.02)
    assert len(starts) == 5, starts
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4 and gaps[2] >= 0.8 and gaps[3] >= 0.8, gaps
    assert gaps[3] < 1.6, f"the delay is capped at restart_backoff_max: {gaps}"
    state = settle(supervisor, lambda: (s := state_of(supervisor, "m-1")) and s.state == "backoff" and s)
    assert state.exit_code == 2 and state.restarts >= 4
    assert "error: unrecognized arguments: --bogus" in state.log_tail
    # No longer wanted: it is dropped, not restarted again.
    supervisor.converge(DesiredState(version=2))
    settle(supervisor, lambda: state_of(supervisor, "m-1") is None, message="dropped")


def test_an_engine_that_served_is_not_restarted(config):
    """With a health check: failed at start only before it first passed it."""
    port = free_port()
    code = (
        "import http.server, threading, time, sys\n"
        f"s = http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler)\n"
        "threading.Thread(target=s.serve_forever, daemon=True).start()\n"
        "time.sleep(1.0); sys.exit(1)\n"
    )
    config = dataclasses.replace(config, restart_backoff=0.1)
    supervisor = Supervisor(config)
    member = python_member("m-1", code, health_url=f"http://127.0.0.1:{port}/")
    supervisor.converge(DesiredState(version=1, members=[member]))
    settle(supervisor, lambda: supervisor.engines()["m-1"].ever_healthy, message="healthy once")
    state = settle(supervisor, lambda: (s := state_of(supervisor, "m-1")) and s.state == "exited" and s)
    for _ in range(10):
        supervisor.tick()
        time.sleep(0.05)
    assert state_of(supervisor, "m-1").state == "exited" and state.restarts == 0
