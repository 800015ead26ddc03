"""A Redis and a PostgreSQL of a test's own, on their own ports, that the test
may stop and start again: the machine's shared servers are never touched.

PostgreSQL refuses to run as root: as root, the cluster belongs to the
``postgres`` OS user and its commands run as that user.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from tests.conftest import free_port, wait_for_port


@dataclass
class OwnRedis:
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "OwnRedis":
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (Debian: apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        wait_for_port("127.0.0.1", self.port, proc=self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or ([shutil.which(name)] if shutil.which(name) else [])
    if not found:
        pytest.fail(f"PostgreSQL's {name} is not installed (Debian: apt-get install postgresql)")
    return found[-1]


@dataclass
class OwnPostgres:
    port: int = field(default_factory=free_port)
    base: Path | None = None

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/llmgw"

    def _run(self, *argv: str) -> None:
        as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*as_postgres, *argv], check=True, capture_output=True, timeout=120)

    def init(self) -> "OwnPostgres":
        self.base = Path(tempfile.mkdtemp(prefix="llmgw-test-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres", "postgres")
        self._run(_pg_bin("initdb"), "-D", str(self.base / "data"), "-U", "postgres", "--auth=trust",
                  "--no-sync", "-E", "UTF8")
        self.start()
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE llmgw")
        return self

    def start(self) -> None:
        options = f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(_pg_bin("pg_ctl"), "-D", str(self.base / "data"), "-l", str(self.base / "log"),
                  "-o", options, "-w", "start")
        wait_for_port("127.0.0.1", self.port)

    def stop(self) -> None:
        if self.base is not None and (self.base / "data" / "postmaster.pid").exists():
            self._run(_pg_bin("pg_ctl"), "-D", str(self.base / "data"), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        self.stop()
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)

    def query(self, sql: str, *params) -> list[tuple]:
        with psycopg.connect(self.url.replace("postgres://", "postgresql://"), connect_timeout=5) as conn:
            return conn.execute(sql, params).fetchall()


@pytest.fixture
def own_services():
    """(redis, postgres): started, migrated by the caller, stopped at the end
    whatever happens. Request it before the process fixtures, so that the
    processes stop before their servers do."""
    redis_server = OwnRedis().start()
    postgres = OwnPostgres()
    try:
        postgres.init()
        yield redis_server, postgres
    finally:
        redis_server.stop()
        postgres.remove()

