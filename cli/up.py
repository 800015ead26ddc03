"""``llmgw up``: first-run set-up, then every process of the control plane.

Imported only once Django is set up (see ``cli/env.py``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import sys
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import DatabaseError, connections

from accounts.services import token_create
from core.choices import CoreEventKind, EventSeverity
from core.events import event_record
from agentapi.command import gunicorn_argv
from pki.services import CA_CERT, SERVER_CERT, SERVER_KEY, pki_ensure_agent_listener

from .commands import beat_argv, web_argv, worker_argv
from .datadir import DataDirNotPrivate, data_dirs_make_private
from .env import child_env, ensure_migrated
from .processes import ProcessGroup, Supervisor, stopped_on_exit


ADMIN_PASSWORD_FILE = "admin-password"
# Threads of each Celery worker process: each may hold a database connection.
WORKER_THREADS = 8
WORKER_THREADS_EMBEDDED = 4
logger = logging.getLogger(__name__)


def data_dir_private() -> None:
    """The data directory (and the PKI and metrics directories, the SQLite
    files, wherever they are) readable by this user alone: what is not gets
    its group and other permissions removed, in a log line naming it; what
    cannot be changed stops ``llmgw up`` before anything starts."""
    roots = [Path(settings.DATA_DIR), Path(settings.PKI_DIR), Path(settings.LLMGW_METRICS_DIR)]
    shared = {Path("/"), Path.home().resolve()}
    if any(root.resolve() in shared for root in roots):
        # Everything under it would lose its group and other permissions.
        raise SystemExit(f"llmgw: {settings.DATA_DIR} is not a directory of llmgw's own; "
                         "give --data-dir (LLMGW_DATA_DIR) one, e.g. ~/llmgw")
    db = settings.DATABASES["default"]
    if db["ENGINE"] == "django.db.backends.sqlite3" and str(db["NAME"]) != ":memory:":
        roots += [Path(f"{db['NAME']}{suffix}") for suffix in ("", "-wal", "-shm", "-journal")]
    try:
        changed = data_dirs_make_private(roots=roots)
    except DataDirNotPrivate as exc:
        raise SystemExit(f"llmgw: the data directory {settings.DATA_DIR} must be private to this user: {exc}") from None
    if changed:
        logger.warning("made private (group and other permissions removed; the data directory holds sessions, "
                       "keys and tokens): %s", ", ".join(str(p) for p in changed))


def first_run(*, host: str) -> list[str]:
    """Migrate, create the authority, the listener's certificate and an admin.

    Returns lines to print. The admin password is written once to a file
    only its owner can read (never printed: output lands in logs and journals).
    """
    lines = []
    settings.DATA_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
    data_dir_private()
    ensure_migrated()
    ips = sorted({"127.0.0.1", host} - {"0.0.0.0", "localhost"})
    if pki_ensure_agent_listener(hosts=["localhost"], ips=ips):
        lines.append(f"created the certificate authority and the agent API certificate in {settings.PKI_DIR}")
    User = get_user_model()
    if not User.objects.filter(is_superuser=True).exists():
        password = secrets.token_urlsafe(12)
        password_file = settings.DATA_DIR / ADMIN_PASSWORD_FILE
        _write_secret(password_file, password + "\n", replace=True)
        User.objects.create_superuser("admin", "", password)
        lines.append(f"created user 'admin'; its password is in {password_file} (readable by you alone; "
                     "change the password in the admin, then delete the file)")
    token_file = settings.DATA_DIR / "ctl-token"
    if not token_file.exists():
        user = User.objects.filter(is_superuser=True).order_by("id").first()
        _write_secret(token_file, token_create(user=user, name="llmgw up").token, replace=False)
        lines.append(f"wrote the API token for 'llmgw ctl' to {token_file}")
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        for folder in settings.CELERY_BROKER_TRANSPORT_OPTIONS.values():
            if isinstance(folder, str):
                Path(folder).mkdir(parents=True, exist_ok=True, mode=0o700)
    return lines


def _write_secret(path: Path, text: str, *, replace: bool) -> None:
    """Create ``path`` 0600 from the start (never readable by others, even for a moment)."""
    if replace:
        path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def exposure_warning(*, host: str, web_port: int) -> str | None:
    """What to tell an operator who serves the web process beyond this machine."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (
        f"WARNING: the web process listens on {host}:{web_port} over plain HTTP: logins, sessions and API tokens "
        "cross the network unencrypted"
        + (", and any Host header is accepted (DJANGO_ALLOWED_HOSTS is unset)" if settings.ALLOWED_HOSTS == ["*"]
           else "")
        + ". Put a TLS reverse proxy in front of it (deploy/nginx-llmgw.conf; docs/security.md), set "
        "LLMGW_PUBLIC_URL=https://... and DJANGO_ALLOWED_HOSTS, and keep the web port reachable from the proxy alone."
    )


def process_commands(
    *, host: str, web_port: int, agent_port: int, agent_workers: int, web_workers: int = 1, workers: int = 1,
) -> dict[str, list[str]]:
    pki = Path(settings.PKI_DIR)
    embedded = settings.CELERY_BROKER_URL.startswith("filesystem://")
    commands = {
        "web": web_argv(host=host, port=web_port, workers=web_workers),
        "agent-api": gunicorn_argv(
            host=host, port=agent_port, certfile=str(pki / SERVER_CERT), keyfile=str(pki / SERVER_KEY),
            cafile=str(pki / CA_CERT), workers=agent_workers,
        ),
    }
    for n in range(1, workers + 1):
        name = "worker" if workers == 1 else f"worker-{n}"
        commands[name] = worker_argv(concurrency=WORKER_THREADS_EMBEDDED if embedded else WORKER_THREADS,
                                     hostname=f"{name}-{os.getpid()}@%h")
    commands["beat"] = beat_argv(schedule=settings.CELERY_BEAT_SCHEDULE_FILENAME)
    return commands


def child_event(name: str, message: str, restarting: bool) -> None:
    """A child of ``llmgw up`` died: a log line always, an Event when the
    database answers. ``llmgw up`` holds no connection between two of these."""
    print(f"llmgw: {message}", file=sys.stderr, flush=True)
    try:
        event_record(kind=CoreEventKind.CONTROL_PLANE, subject=f"llmgw-up/{name}",
                     severity=EventSeverity.WARNING if restarting else EventSeverity.ERROR,
                     message=f"llmgw up: {message}", data={"process": name, "restarting": restarting})
    except DatabaseError as exc:
        logger.warning("no Event for %s's exit: the database did not answer (%s)", name, exc)
    finally:
        connections.close_all()


def run_up(*, host: str, web_port: int, agent_port: int, agent_workers: int = 2, web_workers: int = 1,
           workers: int = 1) -> int:
    warning = exposure_warning(host=host, web_port=web_port)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    lines = first_run(host=host)
    # Set-up is done: this process holds no database connection while it watches its children.
    connections.close_all()
    for line in lines:
        print(line, flush=True)
    password_shown = any(line.startswith("created user") for line in lines)
    commands = process_commands(host=host, web_port=web_port, agent_port=agent_port, agent_workers=agent_workers,
                                web_workers=web_workers, workers=workers)
    group = ProcessGroup(env=child_env(settings.DATA_DIR))
    supervisor = Supervisor(group, commands, notify=child_event)
    with stopped_on_exit(group.stop_all):
        supervisor.start_all()
        db = settings.DATABASES["default"]
        print(
            "\nllmgw is up\n"
            f"  dashboard   http://{host}:{web_port}/   (admin at /admin/, API at /api/v1/, schema at /api/schema/)\n"
            f"  agent API   https://{host}:{agent_port}/agent/v1/   (mTLS, CA {Path(settings.PKI_DIR) / 'ca.pem'})\n"
            f"  data        {settings.DATA_DIR}  (database: {db['ENGINE'].rsplit('.', 1)[-1]}, broker: "
            f"{settings.CELERY_BROKER_URL.split('://')[0]})\n"
            "  a node      llmgw ctl cert issue-client NODE --out DIR, then llmgw agent --config agent.yaml\n"
            + ("" if password_shown else _forgot_password_hint())
            + "A process that exits is started again; Ctrl-C stops everything.\n",
            flush=True,
        )
        given_up = supervisor.run(interval=0.3)
        if given_up is None:
            return 0
        print(f"llmgw: stopping everything: {given_up} cannot be kept running (its output is above)",
              file=sys.stderr, flush=True)
        return 1


def _forgot_password_hint() -> str:
    manage = Path(settings.BASE_DIR) / "manage.py"
    return (
        f"  login       as 'admin', with the password the first run wrote to {settings.DATA_DIR / ADMIN_PASSWORD_FILE};"
        " to set a new one:\n"
        f"              LLMGW_DATA_DIR={settings.DATA_DIR} {sys.executable} {manage} changepassword admin\n"
    )
