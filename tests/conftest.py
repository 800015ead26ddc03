"""Shared fixtures: a test authority, real agent API servers, clean Redis.

The suite runs against PostgreSQL and Redis (``make test`` sets
``DATABASE_URL``, ``CELERY_BROKER_URL`` and ``LLMGW_REDIS_URL``). Servers
started here are real processes bound to 127.0.0.1, reading the test database.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from django.conf import settings

REPO = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def session_processes() -> dict[int, str]:
    """pid -> command line of every process running with this test session's
    mark in its environment (tests/parallel.py sets it; everything a test
    starts inherits it, however it was started and whoever its parent is now)."""
    from tests.parallel import SESSION_MARK

    mark = f"{SESSION_MARK}={os.getpid()}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue  # gone meanwhile, a zombie, or not ours to read
        found[int(entry.name)] = f"pid {entry.name} (parent {ppid}): {argv[:300]}"
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """Every process a test starts is stopped, children included: at the end of
    the session (after every other fixture has stopped its processes) nothing
    this session started may still run. What does is killed, and the session
    fails naming it."""
    yield
    deadline = time.monotonic() + 5  # what was just signalled may still be on its way out
    while (left := session_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, "processes started by the tests were still running at the end of the session:\n  " + (
        "\n  ".join(left.values()))


@pytest.fixture(scope="session")
def pki_dir(tmp_path_factory, django_db_setup, django_db_blocker):
    """A certificate authority and an agent API server certificate for the session."""
    from pki import services

    path = tmp_path_factory.mktemp("pki")
    settings.PKI_DIR = path
    with django_db_blocker.unblock():
        services.ca_init(common_name="llmgw test CA")
        services.cert_issue_server(hosts=["localhost"], ips=["127.0.0.1"], install=True)
    return path


@pytest.fixture(autouse=True)
def _clean_state():
    """Each test starts with an empty liveness store and empty caches."""
    from nodes import heartbeat, liveness
    from pki.selectors import revoked_serials

    liveness.store.cache_clear()
    store = liveness.store()
    if isinstance(store, liveness.RedisLiveness):
        store.client.flushdb()
    heartbeat.forget_cache()
    revoked_serials.invalidate()
    yield


@pytest.fixture
def client_cert(pki_dir, tmp_path, django_db_blocker):
    """issue(node_id) -> (cert path, key path, ca path) for a real client certificate."""
    from pki import services

    def issue(node_id: str, **kwargs) -> tuple[str, str, str]:
        with django_db_blocker.unblock():
            issued = services.cert_issue_client(node_id=node_id, **kwargs)
        paths = services.bundle_write(issued=issued, out_dir=tmp_path / "certs" / node_id)
        return str(paths["cert"]), str(paths["key"]), str(paths["ca"])

    return issue


def server_env(**extra: str) -> dict[str, str]:
    """Environment for a control plane process that shares this test's database."""
    db = settings.DATABASES["default"]
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    env = dict(os.environ)
    env.update(
        DATABASE_URL=url,
        LLMGW_PKI_DIR=str(settings.PKI_DIR),
        LLMGW_DATA_DIR=str(Path(settings.PKI_DIR).parent / "data"),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def kill_group(pgid: int) -> None:
    """SIGKILL a process group (a server started with start_new_session leads
    one); the group lives on while any member does, even once its leader is gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    host: str
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    logs: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        scheme = "https" if self.name == "agent-api" else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def start(self) -> "Server":
        handle = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_for_port(self.host, self.port, proc=self.proc)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_group(self.proc.pid)
                self.proc.wait()
        # Whatever the server started and left (a worker, a parsing process) goes with its
        # group, also when the test killed the server itself.
        kill_group(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
def agent_api_factory(pki_dir, transactional_db, tmp_path):
    """Start real agent API listeners (gunicorn, mTLS) against the test database."""
    from agentapi.command import gunicorn_argv
    from pki.services import CA_CERT, SERVER_CERT, SERVER_KEY

    servers: list[Server] = []

    def make(*, workers: int = 1, threads: int = 4, port: int | None = None, **env: str) -> Server:
        port = port or free_port()
        argv = gunicorn_argv(
            host="127.0.0.1",
            port=port,
            certfile=str(pki_dir / SERVER_CERT),
            keyfile=str(pki_dir / SERVER_KEY),
            cafile=str(pki_dir / CA_CERT),
            workers=workers,
            threads=threads,
        )
        server = Server("agent-api", argv, server_env(**env), "127.0.0.1", port, tmp_path / f"agent-api-{port}.log")
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def agent_api(agent_api_factory):
    return agent_api_factory()


def celery_argv(kind: str) -> list[str]:
    if kind == "worker":
        return [sys.executable, "-m", "celery", "-A", "llmgw_site", "worker", "--loglevel", "INFO",
                "--pool", "threads", "--concurrency", "2", "--without-gossip", "--without-mingle"]
    return [sys.executable, "-m", "celery", "-A", "llmgw_site", "beat", "--loglevel", "INFO"]


def mtls_context(cert: str, key: str, ca: str):
    import ssl

    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(cert, key)
    return context


def mtls_client(cert: str, key: str, ca: str, **kwargs):
    """An httpx client presenting a node's certificate, trusting our authority."""
    import httpx

    return httpx.Client(verify=mtls_context(cert, key, ca), **kwargs)


@pytest.fixture
def web_factory(pki_dir, transactional_db, tmp_path):
    """Start the real web process (uvicorn, ASGI) against the test database."""
    servers: list[Server] = []

    def make(*, port: int | None = None, http: str | None = None, **env: str) -> Server:
        """``http``: another uvicorn --http class than the one 'llmgw up' passes (web.protocol)."""
        port = port or free_port()
        from cli.commands import web_argv

        argv = web_argv(host="127.0.0.1", port=port)
        if http is not None:
            argv[argv.index("--http") + 1] = http
        server = Server("web", argv, server_env(**env), "127.0.0.1", port, tmp_path / f"web-{port}.log")
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def admin_token(transactional_db):
    """An operator API token (what 'llmgw ctl' sends as LLMGW_TOKEN)."""
    from django.contrib.auth import get_user_model

    from accounts.services import token_create

    user = get_user_model().objects.create_superuser("admin", "", "admin-password-for-tests")
    return token_create(user=user).token


# --- reconcile enqueueing switched off --------------------------------------------


@pytest.fixture
def no_reconcile_enqueue(monkeypatch) -> list[float]:
    """No Celery worker here: the reconcile a service asks for after commit is
    not sent; the test runs ``reconcile.replicas_reconcile()`` itself when it
    wants one. Returns the countdowns of the reconciles that were asked for, so
    that a test can check one was. The only place that names how a reconcile
    is enqueued: when that changes, change it here."""
    from replicas import enqueue

    asked: list[float] = []
    monkeypatch.setattr(enqueue, "reconcile_request", lambda *, countdown=0.0: asked.append(float(countdown)))
    return asked


@pytest.fixture
def engine_user_that_exists(settings, monkeypatch):
    """Onboarding creates the engines' user on the node, and the test nodes
    are this host: name one that exists (nobody), so that no test adds a
    user to the machine it runs on. Workers started here inherit it."""
    settings.LLMGW_ENGINE_USER = "nobody"
    monkeypatch.setenv("LLMGW_ENGINE_USER", "nobody")
