"""``llmgw up``: first-run set-up, then every process of the control plane."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings

logger = logging.getLogger(__name__)


def first_run(*, host: str) -> list[str]:
    """Migrate, create the authority, the listener's certificate and an admin.

    Returns lines to print (the admin password appears exactly once, ever).
    """
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from pki.services import pki_ensure_agent_listener

    from .cli import ensure_migrated

    lines = []
    settings.DATA_DIR.mkdir(parents=True, exist_ok=True)
    ensure_migrated()
    ips = sorted({"127.0.0.1", host} - {"0.0.0.0", "localhost"})
    if pki_ensure_agent_listener(hosts=["localhost"], ips=ips):
        lines.append(f"created the certificate authority and the agent API certificate in {settings.PKI_DIR}")
    User = get_user_model()
    if not User.objects.filter(is_superuser=True).exists():
        password = secrets.token_urlsafe(12)
        user = User.objects.create_superuser("admin", "", password)
        lines.append(f"created user 'admin' with password {password}  (shown once; change it in the admin)")
    else:
        user = User.objects.filter(is_superuser=True).order_by("id").first()
    token, _ = Token.objects.get_or_create(user=user)
    token_file = settings.DATA_DIR / "ctl-token"
    if not token_file.exists():
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(token.key)
        lines.append(f"wrote the API token for 'llmgw ctl' to {token_file}")
    return lines


def web_argv(*, host: str, port: int) -> list[str]:
    """The web process (site, operator API, gateway), as every caller starts it.

    Lifespan events on: the gateway flushes its usage counts at shutdown.
    """
    return [sys.executable, "-m", "uvicorn", "llmgw_site.asgi:application", "--host", host, "--port", str(port),
            "--no-access-log", "--lifespan", "on"]


def process_commands(*, host: str, web_port: int, agent_port: int, agent_workers: int) -> dict[str, list[str]]:
    from pki.services import CA_CERT, SERVER_CERT, SERVER_KEY

    from .agent_server import gunicorn_argv

    py = sys.executable
    pki = Path(settings.PKI_DIR)
    embedded = settings.CELERY_BROKER_URL.startswith("filesystem://")
    return {
        # Lifespan events start the gateway's routing table before the first
        # /v1 request and write its last usage counts on the way out.
        "web": web_argv(host=host, port=web_port),
        "agent-api": gunicorn_argv(
            host=host, port=agent_port, certfile=str(pki / SERVER_CERT), keyfile=str(pki / SERVER_KEY),
            cafile=str(pki / CA_CERT), workers=agent_workers,
        ),
        "worker": [py, "-m", "celery", "-A", "llmgw_site", "worker", "--loglevel", "INFO",
                   "--pool", "threads", "--concurrency", "4" if embedded else "8", "--without-gossip",
                   "--without-mingle", "--hostname", f"worker-{os.getpid()}@%h"],
        "beat": [py, "-m", "celery", "-A", "llmgw_site", "beat", "--loglevel", "INFO",
                 "--schedule", settings.CELERY_BEAT_SCHEDULE_FILENAME],
    }


def run_up(*, host: str, web_port: int, agent_port: int, agent_workers: int = 2) -> int:
    lines = first_run(host=host)
    for line in lines:
        print(line, flush=True)
    password_shown = any(line.startswith("created user") for line in lines)
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        for folder in settings.CELERY_BROKER_TRANSPORT_OPTIONS.values():
            if isinstance(folder, str):
                Path(folder).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LLMGW_DATA_DIR=str(settings.DATA_DIR), PYTHONUNBUFFERED="1")
    commands = process_commands(host=host, web_port=web_port, agent_port=agent_port, agent_workers=agent_workers)
    children: dict[str, subprocess.Popen] = {}
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for name, argv in commands.items():
        children[name] = subprocess.Popen(argv, env=env, start_new_session=True)
    db = settings.DATABASES["default"]
    print(
        "\nllmgw is up\n"
        f"  dashboard   http://{host}:{web_port}/   (admin at /admin/, API at /api/v1/, schema at /api/schema/)\n"
        f"  agent API   https://{host}:{agent_port}/agent/v1/   (mTLS, CA {Path(settings.PKI_DIR) / 'ca.pem'})\n"
        f"  data        {settings.DATA_DIR}  (database: {db['ENGINE'].rsplit('.', 1)[-1]}, broker: "
        f"{settings.CELERY_BROKER_URL.split('://')[0]})\n"
        "  a node      llmgw ctl cert issue-client NODE --out DIR, then llmgw agent --config agent.yaml\n"
        + ("" if password_shown else _forgot_password_hint())
        + "Ctrl-C stops everything.\n",
        flush=True,
    )
    exit_code = 0
    while not stopping:
        for name, child in children.items():
            if child.poll() is not None:
                print(f"llmgw: {name} exited with status {child.returncode}; stopping", file=sys.stderr, flush=True)
                exit_code = 1
                stopping = True
                break
        time.sleep(0.3)
    for child in children.values():
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for child in children.values():
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(child, signal.SIGKILL)
            child.wait()
    return exit_code


def _signal_group(child: subprocess.Popen, signum: int) -> None:
    """Signal a child's whole process group (gunicorn has workers of its own);
    a group that has already gone is not an error."""
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass


def _forgot_password_hint() -> str:
    manage = Path(settings.BASE_DIR) / "manage.py"
    return (
        "  login       as 'admin', with the password printed on the first run; to set a new one:\n"
        f"              LLMGW_DATA_DIR={settings.DATA_DIR} {sys.executable} {manage} changepassword admin\n"
    )
