#!/usr/bin/env python3
"""The production process set from a runtime-only install.

A virtual environment made from ``requirements.txt`` and the project alone
(no development packages, which pull in what a runtime install may lack), then
``llmgw up`` against PostgreSQL and Redis: web, agent API, Celery worker and
beat. A simulated node registers over mTLS and a one-GPU sim replica becomes
ready. Anything that dies at start (a dependency the test suite's packages
hide) fails this check. The installed catalog must also refuse an unknown
and an abbreviated vLLM flag with the very message the checkout gives (the
engines' option tables are package data, not files of the checkout).

    python3 scripts/prod_check.py      (make prod-check; CI runs it)

It uses its own database (llmgw_prodcheck, dropped and created) and Redis
database (13), so the test suite's are left alone. Loopback only; every
process it starts, it stops. Standard library only: it runs before any venv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CATALOG = """\
models:
  - name: prod-check
    engine: sim
    model: /models/prod-check
    nodes: 1
    gpus_per_node: 1
    replicas: 1
"""


def log(message: str) -> None:
    print(f"prod-check: {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, text=True, capture_output=True, **kwargs)


def make_venv(venv: Path, *, reuse: bool) -> None:
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "install", "--quiet"]
    if not (reuse and (venv / "bin" / "python").exists()):
        if venv.exists():
            shutil.rmtree(venv)
        log(f"runtime-only virtual environment in {venv}")
        run([sys.executable, "-m", "venv", str(venv)])
    run(pip + ["-r", str(REPO / "requirements.txt")])
    # A real (not editable) install: the checkout is not on the path. Built
    # from a copy, so that setuptools' build/ and egg-info stay out of the
    # checkout (a stale build/lib would be installed next time).
    with tempfile.TemporaryDirectory(prefix="llmgw-prod-check-src-") as src:
        shutil.copytree(REPO, src, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "var", "build", "*.egg-info", ".engine-venvs", "__pycache__"))
        run(pip + ["--no-deps", "--force-reinstall", src])


def reset_services(database: str, redis_db: int) -> None:
    psql = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c"]
    run(psql + [f"DROP DATABASE IF EXISTS {database} WITH (FORCE)"])
    run(psql + [f"CREATE DATABASE {database}"])
    with socket.create_connection(("127.0.0.1", 6379), timeout=5) as s:
        s.sendall(f"SELECT {redis_db}\r\nFLUSHDB\r\nQUIT\r\n".encode())
        reply = b""
        while chunk := s.recv(1024):
            reply += chunk
    if reply.count(b"+OK") < 2:
        raise SystemExit(f"prod-check: could not empty Redis database {redis_db}: {reply!r}")


def wait_for(what: str, check, *, timeout: float, procs: dict[str, subprocess.Popen]) -> object:
    deadline = time.monotonic() + timeout
    while True:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise SystemExit(f"prod-check: {name} exited with {proc.returncode} while waiting for {what}")
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"prod-check: no {what} after {timeout:.0f}s")
        time.sleep(0.5)


def ctl_json(llmgw: str, env: dict[str, str], *args: str) -> list[dict]:
    done = subprocess.run([llmgw, "ctl", *args, "-o", "json"], env=env, text=True, capture_output=True)
    if done.returncode != 0:
        return []
    return json.loads(done.stdout)


# Flags the engines' option tables refuse, and nothing else would: without the
# tables an unknown flag is indistinguishable from a newer engine's.
BAD_FLAGS = (["--tensor-paralel-size", "2"], ["--max-model", "4096"])
CHECKOUT_REFUSAL = """\
import json, sys
from replicas.engines import EngineArgsError, check_entry
try:
    check_entry(engine="vllm", name="prod-check-flags", args=json.loads(sys.argv[1]), env={}, nodes=1, gpus_per_node=1)
except EngineArgsError as exc:
    print(exc)
"""


def flags_refused_as_in_checkout(llmgw: str, env: dict[str, str], cwd: str, work: Path) -> None:
    """``ctl apply`` of an entry with a bad flag, on the runtime-only install,
    fails with the message the checkout's adapters give for the same args."""
    for args in BAD_FLAGS:
        # replicas.engines imports only the standard library: any python reads the checkout's.
        expected = run([sys.executable, "-c", CHECKOUT_REFUSAL, json.dumps(args)], cwd=str(REPO),
                       env={**env, "PYTHONPATH": str(REPO)}).stdout.strip()
        if not expected:
            raise SystemExit(f"prod-check: the checkout accepted vllm args {args}; pick a flag it refuses")
        catalog = work / "bad-flags.yaml"
        catalog.write_text(
            "models:\n  - name: prod-check-flags\n    engine: vllm\n    model: /models/x\n"
            f"    nodes: 1\n    gpus_per_node: 1\n    replicas: 0\n    args: {json.dumps(args)}\n"
        )
        done = subprocess.run([llmgw, "ctl", "apply", "-f", str(catalog)], env=env, cwd=cwd, text=True, capture_output=True)
        answer = done.stdout + done.stderr
        if done.returncode == 0 or expected not in answer:
            raise SystemExit(
                f"prod-check: the installed catalog answered vllm args {args} with exit {done.returncode}: "
                f"{answer.strip()!r}; the checkout refuses them with {expected!r}"
            )
        log(f"vllm args {' '.join(args)} refused as in the checkout: {expected}")


def stop(proc: subprocess.Popen, signum: int = signal.SIGINT) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=str(REPO / "var" / "prod-check"))
    parser.add_argument("--database", default="llmgw_prodcheck")
    parser.add_argument("--redis-db", type=int, default=13)
    parser.add_argument("--reuse-venv", action="store_true", help="keep an existing venv: add what requirements.txt gained, reinstall the project (quicker reruns)")
    args = parser.parse_args()

    work = Path(args.work).resolve()
    venv = work / "venv"
    make_venv(venv, reuse=args.reuse_venv)
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    reset_services(args.database, args.redis_db)

    llmgw = str(venv / "bin" / "llmgw")
    web_port, agent_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:6379/{args.redis_db}"
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("LLMGW_", "DATABASE_", "CELERY_"))
    }
    env.update(
        DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{args.database}",
        CELERY_BROKER_URL=redis_url,
        LLMGW_REDIS_URL=redis_url,
        LLMGW_DATA_DIR=str(data),
        LLMGW_URL=f"http://127.0.0.1:{web_port}",
        PYTHONUNBUFFERED="1",
        PYTHONPATH="",
    )
    # Anywhere but the checkout, so that nothing is imported from it.
    cwd = tempfile.mkdtemp(prefix="llmgw-prod-check-")
    procs: dict[str, subprocess.Popen] = {}
    up_log = open(work / "up.log", "w")
    agent_log = open(work / "agent.log", "w")
    try:
        log(f"llmgw up on PostgreSQL ({args.database}) and Redis (db {args.redis_db})")
        procs["llmgw up"] = subprocess.Popen(
            [llmgw, "up", "--web-port", str(web_port), "--agent-port", str(agent_port)],
            env=env, cwd=cwd, stdout=up_log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_for("'llmgw is up'", lambda: "llmgw is up" in (work / "up.log").read_text(), timeout=120, procs=procs)
        # The worker and beat must survive their start (a missing import kills them in the first seconds).
        time.sleep(5)

        kit = work / "node01"
        run([llmgw, "ctl", "cert", "issue-client", "node01", "--out", str(kit)], env=env, cwd=cwd)
        run(
            [llmgw, "sim", "node-kit", "node01", "--dir", str(kit), "--gpus", "2", "--fabric", "ib-a",
             "--addr", "127.0.1.1", "--server", f"https://127.0.0.1:{agent_port}", "--heartbeat-interval", "1"],
            env=env, cwd=cwd,
        )
        procs["agent"] = subprocess.Popen(
            [llmgw, "agent", "--config", str(kit / "agent.yaml")],
            env=env, cwd=cwd, stdout=agent_log, stderr=subprocess.STDOUT, start_new_session=True,
        )

        def node_ready():
            return [n for n in ctl_json(llmgw, env, "nodes") if n.get("name") == "node01" and n.get("status") == "ready"]

        wait_for("node01 registered and ready", node_ready, timeout=60, procs=procs)
        log("node01 registered over mTLS")

        catalog = work / "catalog.yaml"
        catalog.write_text(CATALOG)
        run([llmgw, "ctl", "apply", "-f", str(catalog)], env=env, cwd=cwd)

        def replica_ready():
            return [r for r in ctl_json(llmgw, env, "replicas") if r.get("status") == "ready"]

        wait_for("ready replica of prod-check", replica_ready, timeout=90, procs=procs)
        log("a sim replica is ready: web, agent API, worker and beat all ran from a runtime-only install")

        flags_refused_as_in_checkout(llmgw, env, cwd, work)

        # Onboarding builds the agent's wheels and installs its unit from the
        # installed package (agent/dist), not from a checkout.
        python = str(venv / "bin" / "python")
        run([python, "-c", "from provisioning.agentwheel import PYPROJECT, UNIT_FILE, AGENT_SRC; "
                           "import sys; assert 'site-packages' in str(AGENT_SRC), AGENT_SRC; "
                           "assert PYPROJECT.is_file() and UNIT_FILE.is_file(), (PYPROJECT, UNIT_FILE)"],
            env=env, cwd=cwd)
        built = run([python, "-m", "provisioning.agentwheel", str(work / "agent-wheels")], env=env, cwd=cwd)
        names = [Path(line).name for line in built.stdout.split()]
        if not any(n.startswith("llmgw_agent-") for n in names) or not any(n.startswith("pip-") for n in names):
            raise SystemExit(f"prod-check: the agent's wheels from the installed package lack the agent or pip: {names}")
        log(f"the agent's wheels build from the installed package ({len(names)} wheels)")
        return 0
    except (SystemExit, subprocess.CalledProcessError) as exc:
        if isinstance(exc, subprocess.CalledProcessError):
            print(f"prod-check: {' '.join(exc.cmd)} failed ({exc.returncode}):\n{exc.stdout}{exc.stderr}", flush=True)
        else:
            print(exc, flush=True)
        for path in (work / "up.log", work / "agent.log"):
            print(f"--- last lines of {path}", flush=True)
            print("\n".join(path.read_text().splitlines()[-40:]), flush=True)
        return 1
    finally:
        if "agent" in procs:
            stop(procs["agent"], signal.SIGKILL)
        if "llmgw up" in procs:
            stop(procs["llmgw up"])
        # The agent's engines run in sessions of their own (they outlive an agent restart).
        subprocess.run(["pkill", "-KILL", "-f", str(venv / "bin")], check=False)
        shutil.rmtree(cwd, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
