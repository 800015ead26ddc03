"""The command line of each control-plane process, as every caller starts it
(``llmgw up``, ``llmgw demo``, the tests, the benchmarks). The agent API's is
``agentapi.command.gunicorn_argv``. Nothing here needs Django set up."""

from __future__ import annotations

import sys


def web_argv(*, host: str, port: int, workers: int = 1) -> list[str]:
    """The web process (site, operator API, gateway).

    Lifespan events on: they start the gateway's routing table before the
    first /v1 request and write its last usage counts on the way out.
    The HTTP protocol bounds request heads before anything is authenticated
    (web/protocol.py). With ``workers`` above one, uvicorn forks that many
    processes on the one port and starts again any that dies.
    """
    return [sys.executable, "-m", "uvicorn", "llmgw_site.asgi:application", "--host", host, "--port", str(port),
            "--no-access-log", "--lifespan", "on", "--http", "web.protocol:HttpProtocol",
            *(["--workers", str(workers)] if workers > 1 else [])]


def worker_argv(*, concurrency: int, hostname: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "llmgw_site", "worker", "--loglevel", "INFO",
            "--pool", "threads", "--concurrency", str(concurrency), "--without-gossip",
            "--without-mingle", "--hostname", hostname]


def beat_argv(*, schedule: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "llmgw_site", "beat", "--loglevel", "INFO", "--schedule", schedule]
