"""A Celery worker (threads pool) that counts reconcile passes in Redis, for
``bench/mass_loss.py``: every call of ``replicas.reconcile.replicas_reconcile``
(``bench:passes``, ``bench:pass_seconds``) and every reconcile task message
run (``bench:tasks``), whichever tree's code calls them."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

import django  # noqa: E402

django.setup()

import redis  # noqa: E402
from celery import signals  # noqa: E402

from replicas import reconcile  # noqa: E402

counts = redis.Redis.from_url(os.environ["LLMGW_REDIS_URL"])
reconcile_pass = reconcile.replicas_reconcile


def counted_pass() -> None:
    start = time.perf_counter()
    try:
        reconcile_pass()
    finally:
        counts.incr("bench:passes")
        counts.incrbyfloat("bench:pass_seconds", time.perf_counter() - start)


reconcile.replicas_reconcile = counted_pass


@signals.task_prerun.connect
def _count_task(sender=None, **_kwargs) -> None:
    if sender is not None and sender.name == "replicas.tasks.replicas_reconcile":
        counts.incr("bench:tasks")


@signals.worker_ready.connect
def _ready(**_kwargs) -> None:
    counts.set("bench:ready", 1)


if __name__ == "__main__":
    from celery.__main__ import main

    concurrency = sys.argv[sys.argv.index("--concurrency") + 1] if "--concurrency" in sys.argv else "8"
    sys.argv = ["celery", "-A", "llmgw_site", "worker", "--loglevel", "WARNING", "--pool", "threads",
                "--concurrency", concurrency, "--without-gossip", "--without-mingle"]
    sys.exit(main())
