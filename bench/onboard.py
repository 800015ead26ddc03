#!/usr/bin/env python
"""Onboarding benchmark: many machines onboarded at once over real SSH.

    .venv/bin/python bench/onboard.py                  # 20 nodes, a worker of 8 threads (as llmgw up)
    .venv/bin/python bench/onboard.py --nodes 40 --concurrency 8

Each machine is a real OpenSSH sshd on its own loopback address (127.0.1.x)
with its own host key, and a node that is a directory tree of its own (fake
nvidia-smi, fake InfiniBand sysfs, a ``systemctl`` that runs the unit as a
plain process; tests/provisioning/sshnode.py). The control plane is a
benchmark database (``llmgw_bench_onboard``, dropped and migrated here), the
real agent API (gunicorn, mTLS) and one Celery worker (threads pool). The
agent's wheels are built once before the clock starts; every job uploads the
same build.

Checks: every job succeeded, every node heartbeats, the wheels were built
once. Prints the time until all are ready and each step's slowest and median
time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DB_NAME = "llmgw_bench_onboard"


def _recreate_database(server: str) -> None:
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB_NAME}")


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8, help="worker threads or processes (8, as llmgw up)")
    parser.add_argument("--pool", default="threads", choices=["threads", "prefork"], help="the worker's pool (threads, as llmgw up)")
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/3")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="llmgw-onboard-bench-"))
    os.environ.update({
        "DATABASE_URL": f"{args.pg}/{DB_NAME}",
        "CELERY_BROKER_URL": args.redis,
        "LLMGW_REDIS_URL": args.redis,
        "LLMGW_DATA_DIR": str(base / "data"),
        "LLMGW_PROVISION_POLL_MIN": "0.5",
        "LLMGW_PROVISION_POLL_MAX": "2",
        "PYTHONUNBUFFERED": "1",
    })
    _recreate_database(args.pg)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    import django

    django.setup()
    import redis
    from django.conf import settings
    from django.core.management import call_command

    redis.Redis.from_url(args.redis).flushdb()
    call_command("migrate", verbosity=0)
    from agent.simkit import KitFabric
    from agentapi.command import gunicorn_argv
    from nodes.models import Node
    from pki import services as pki
    from provisioning import agentwheel, sshkeys
    from provisioning.choices import TERMINAL
    from provisioning.models import Job, Step
    from provisioning.onboard.request import job_onboard_create
    from tests.conftest import free_port, wait_for_port
    from tests.provisioning.sshnode import SshNode, node_root

    pki.ca_init(common_name="llmgw bench CA")
    pki.cert_issue_server(hosts=["localhost"], ips=["127.0.0.1"], install=True)
    built = time.monotonic()
    wheels = agentwheel.wheels_ensure(Path(settings.DATA_DIR) / "agent-wheels")
    print(f"agent wheels built once in {time.monotonic() - built:.1f} s: {wheels}")

    api_port = free_port()
    pki_dir = Path(settings.PKI_DIR)
    api = subprocess.Popen(
        gunicorn_argv(host="127.0.0.1", port=api_port, certfile=str(pki_dir / pki.SERVER_CERT),
                      keyfile=str(pki_dir / pki.SERVER_KEY), cafile=str(pki_dir / pki.CA_CERT), workers=1, threads=8),
        env=dict(os.environ), cwd=REPO, stdout=open(base / "agent-api.log", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "llmgw_site", "worker", "--pool", args.pool, "--concurrency",
         str(args.concurrency), "--without-gossip", "--without-mingle", "--loglevel", "WARNING"],
        env=dict(os.environ), cwd=REPO, stdout=open(base / "worker.log", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    key = sshkeys.control_plane_public_key()
    machines = []
    try:
        wait_for_port("127.0.0.1", api_port, proc=api)
        for i in range(args.nodes):
            host = f"127.0.1.{100 + i}"
            machines.append(SshNode(f"bench-onb{i:02d}", host, free_port(host), node_root(f"llmgw-bench-onb{i:02d}-"),
                                    [key], fabrics=[KitFabric("ib-a", ("mlx5_0", "mlx5_1"))]).start())
        time.sleep(3)
        started, cpu_before = time.monotonic(), _cpu_jiffies()
        ids = [job_onboard_create(request=dict(
            node=m.node_id, addr=m.host, ssh_port=m.port, fabrics=["ib-a"], mgmt_interface="lo",
            nvidia_smi=str(m.nvidia_smi), ib_root=str(m.ib_root), root=str(m.root),
            agent_server=f"https://127.0.0.1:{api_port}", host_key_fingerprint=sshkeys.fingerprint(m.host_key),
        )).pk for m in machines]
        while time.monotonic() - started < args.timeout:
            if Job.objects.filter(pk__in=ids, status__in=TERMINAL).count() == len(ids):
                break
            time.sleep(0.2)
        wall = time.monotonic() - started
        cpu_after = _cpu_jiffies()
    finally:
        for machine in machines:
            machine.remove()
        for proc in (worker, api):
            proc.terminate()
            proc.wait(20)

    statuses = Counter(Job.objects.filter(pk__in=ids).values_list("status", flat=True))
    heartbeating = Node.objects.filter(name__in=[m.node_id for m in machines]).count()
    builds = [p for p in (Path(settings.DATA_DIR) / "agent-wheels").iterdir() if p.is_dir()]
    durations = defaultdict(list)
    for step in Step.objects.filter(job_id__in=ids).exclude(started_at=None).exclude(finished_at=None):
        durations[step.title].append(((step.finished_at - step.started_at).total_seconds(), step.job.node_name))
    busy = (cpu_after[0] - cpu_before[0]) / max(1, cpu_after[1] - cpu_before[1])
    cpu_seconds = (cpu_after[0] - cpu_before[0]) / os.sysconf("SC_CLK_TCK")
    print(f"nodes: {len(ids)}, worker pool: {args.pool} x {args.concurrency}; machine: {os.cpu_count()} cores, "
          f"{busy:.0%} busy during the run ({cpu_seconds:.0f} CPU-seconds, {cpu_seconds / len(ids):.1f} per node, "
          "control plane and nodes together)")
    print(f"all ready in {wall:.1f} s: jobs {dict(statuses)}, nodes heartbeating {heartbeating}, "
          f"wheel builds {len(builds)}")
    for title, values in durations.items():
        slowest = max(values)
        print(f"  {title:50} slowest {slowest[0]:5.1f} s ({slowest[1]}), median "
              f"{statistics.median(v for v, _ in values):5.1f} s")
    slowest = max((v, t, n) for t, values in durations.items() for v, n in values)
    print(f"slowest step: {slowest[1]} on {slowest[2]}, {slowest[0]:.1f} s")
    ok = statuses.get("succeeded") == len(ids) and heartbeating == len(ids) and len(builds) == 1
    if not ok:
        for job in Job.objects.filter(pk__in=ids).exclude(status="succeeded")[:5]:
            print(f"  job {job.pk} {job.node_name}: {job.status} {job.status_reason}")
    print("OK" if ok else f"FAILED (logs in {base})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
