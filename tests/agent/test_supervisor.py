"""The supervisor against real processes: start, watch, stop, adopt.

Until scheduling exists the control plane never asks for members, so these
drive the supervisor directly with a DesiredState.
"""

from __future__ import annotations

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
    supervisor = Supervisor(config)
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

