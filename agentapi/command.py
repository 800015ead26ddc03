"""The command line that serves the agent API: gunicorn with our worker class."""

from __future__ import annotations

import os
import ssl
import sys

from django.conf import settings


def gunicorn_argv(
    *,
    host: str,
    port: int,
    certfile: str,
    keyfile: str,
    cafile: str,
    workers: int = 2,
    threads: int = 16,
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "agentapi.wsgi:application",
        # Django set up before the worker class is imported (it uses the models).
        "--config",
        "python:agentapi.gunicorn_conf",
        "--bind",
        f"{host}:{port}",
        "--worker-class",
        "agentapi.parking.AgentApiParkingWorker",
        "--workers",
        str(workers),
        "--threads",
        str(threads),
        # Above the cluster's size: every agent keeps a connection open.
        "--worker-connections",
        "10000",
        # Longer than the heartbeat interval, so heartbeats reuse their TLS session.
        # (The worker reads LLMGW_AGENT_IDLE_TIMEOUT itself; this keeps gunicorn's view the same.)
        "--keep-alive",
        f"{settings.LLMGW_AGENT_IDLE_TIMEOUT:g}",
        "--certfile",
        os.path.abspath(certfile),
        "--keyfile",
        os.path.abspath(keyfile),
        "--ca-certs",
        os.path.abspath(cafile),
        "--cert-reqs",
        str(int(ssl.CERT_REQUIRED)),
        "--no-control-socket",
        "--graceful-timeout",
        "5",
        *(["--access-logfile", "-"] if settings.LLMGW_AGENT_ACCESS_LOG else []),
        "--error-logfile",
        "-",
        "--log-level",
        settings.LLMGW_AGENT_LOG_LEVEL,
    ]
