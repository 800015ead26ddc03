#!/usr/bin/env python
"""Provisioning benchmark: many jobs at once against the test's Proxmox.

    .venv/bin/python bench/provision.py                # 50 jobs, 3 s per Proxmox task, 4 worker threads
    .venv/bin/python bench/provision.py --jobs 100 --task-secs 5

The Proxmox is the test suite's (fakepve over HTTPS, tests/provisioning/pve.py)
with every task (create, resize, start) taking ``--task-secs``; each new VM's
address (127.0.78.x) answers SSH from a small asyncssh server. One Celery
worker (threads pool, ``--concurrency``) runs the jobs against a benchmark
database (``llmgw_bench_provision``, dropped and migrated here) and its own
Redis database.

Checks: every job succeeded, every VM was created once, no VMID twice. Prints
jobs/s, each step's slowest and median time, and the wall time against what
it would be if a wait held a worker slot for the task's whole duration.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DB_NAME = "llmgw_bench_provision"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.78.1", 0))
        return sock.getsockname()[1]


def _recreate_database(server: str) -> None:
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB_NAME}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--task-secs", type=float, default=3.0, help="how long each Proxmox task takes (3)")
    parser.add_argument("--concurrency", type=int, default=4, help="worker threads (4)")
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/2")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="llmgw-provision-"))
    ssh_port = _free_port()
    env = {
        "DATABASE_URL": f"{args.pg}/{DB_NAME}",
        "CELERY_BROKER_URL": args.redis,
        "LLMGW_REDIS_URL": args.redis,
        "LLMGW_DATA_DIR": str(base / "data"),
        "LLMGW_PROVISION_SSH_PORT": str(ssh_port),
        "LLMGW_PROVISION_POLL_MIN": "0.5",
        "LLMGW_PROVISION_POLL_MAX": "2",
        "PYTHONUNBUFFERED": "1",
    }
    os.environ.update(env)
    _recreate_database(args.pg)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    import django

    django.setup()
    import redis
    from django.core.management import call_command

    redis.Redis.from_url(args.redis).flushdb()
    call_command("migrate", verbosity=0)
    from provisioning import services
    from provisioning.choices import TERMINAL, JobStatus
    from provisioning.models import Job, Step
    from tests.provisioning.pve import IMAGE, TOKEN_ID, TOKEN_SECRET, Loop, pve_make, ssh_server

    loop = Loop()
    pve, cert = pve_make(base)
    pve.time_scale, pve.task_secs = 1.0, args.task_secs
    loop.call(pve.start(pve.certfile, pve.keyfile))
    hosts = [f"127.0.78.{i + 1}" for i in range(args.jobs)]
    servers = [loop.call(ssh_server(host, ssh_port))[0] for host in hosts]
    services.hypervisor_create(actor="bench", name="pve", url=pve.url, token_id=TOKEN_ID, token_secret=TOKEN_SECRET,
                               ca_pem=Path(cert).read_text(), node="pve1", image=IMAGE)

    log = open(base / "worker.log", "wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "llmgw_site", "worker", "--pool", "threads", "--concurrency",
         str(args.concurrency), "--without-gossip", "--without-mingle", "--loglevel", "WARNING"],
        env=dict(os.environ), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        time.sleep(3)
        started = time.monotonic()
        jobs = [
            services.job_provision_create(request=dict(
                node=f"bench-node{i:03d}", hypervisor="pve", vmid=1000 + i, ip=f"{host}/24",
                gateway="127.0.78.254", cores=2, memory=2048, disk="20G"))
            for i, host in enumerate(hosts)
        ]
        ids = [j.pk for j in jobs]
        while time.monotonic() - started < args.timeout:
            done = Job.objects.filter(pk__in=ids, status__in=TERMINAL).count()
            if done == len(ids):
                break
            time.sleep(0.5)
        wall = time.monotonic() - started
    finally:
        worker.terminate()
        worker.wait(20)
        for server in servers:
            server.close()

    statuses = Counter(Job.objects.filter(pk__in=ids).values_list("status", flat=True))
    creates = Counter(body.split(b"vmid=")[1].split(b"&")[0] for method, path, body in pve.requests
                      if method == "POST" and path.endswith("/nodes/pve1/qemu"))
    vmids = [vm.vmid for vm in pve.vms]
    print(f"jobs: {len(ids)}, worker threads: {args.concurrency}, each Proxmox task {args.task_secs:.1f} s")
    print(f"  outcome: {dict(statuses)}")
    print(f"  VMs: {len(vmids)} ({len(set(vmids))} distinct VMIDs); creates per VMID: max {max(creates.values())}")
    print(f"  wall time: {wall:.1f} s, {len(ids) / wall:.2f} jobs/s")
    held = len(ids) * 3 * args.task_secs / args.concurrency
    print(f"  if each wait held a worker slot: at least {held:.0f} s ({len(ids)} jobs x 3 tasks x "
          f"{args.task_secs:.0f} s / {args.concurrency} slots)")
    print("  step          median   slowest")
    for name in ("validate", "vmid", "create", "resize", "start", "ssh"):
        durations = [(s.finished_at - s.started_at).total_seconds()
                     for s in Step.objects.filter(job_id__in=ids, name=name).exclude(finished_at=None)]
        if durations:
            print(f"  {name:12} {statistics.median(durations):6.2f} s {max(durations):7.2f} s")
    failures = Job.objects.filter(pk__in=ids).exclude(status=JobStatus.SUCCEEDED)[:3]
    for job in failures:
        print(f"  failed: job {job.pk} {job.node_name}: {job.status_reason}")
    ok = (statuses == Counter({JobStatus.SUCCEEDED: len(ids)}) and len(vmids) == len(set(vmids)) == len(ids)
          and max(creates.values()) == 1)
    loop.call(pve.stop())
    print("OK" if ok else f"FAILED (worker log: {base / 'worker.log'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
