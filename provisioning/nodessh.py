"""SSH to a node, only to its pinned host key.

The pin is either the whole host key recorded when llmgw created the machine,
or a SHA256 fingerprint the operator confirmed. Nothing is trusted on first
use: no known_hosts file, and never ``known_hosts=None``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import shlex
from dataclasses import dataclass

import asyncssh

from . import sshkeys

# asyncssh logs every channel at INFO, commands included: a line per command
# of every job would drown the worker's log.
logging.getLogger("asyncssh").setLevel(logging.WARNING)

CONNECT_TIMEOUT = 20.0
COMMAND_TIMEOUT = 300.0


class HostKeyMismatch(Exception):
    pass


class NodeUnreachable(Exception):
    pass


@dataclass(frozen=True)
class Pin:
    """A whole key line, or only a fingerprint ('SHA256:...')."""

    key_line: str = ""
    fingerprint: str = ""

    def describe(self) -> str:
        return self.fingerprint or sshkeys.fingerprint(self.key_line)


@dataclass(frozen=True)
class Result:
    rc: int
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def text(self) -> str:
        return (self.err.strip() or self.out.strip())[-1500:]


class _PinnedClient(asyncssh.SSHClient):
    def __init__(self, pin: Pin, seen: list):
        self._pin = pin
        self._seen = seen

    def validate_host_public_key(self, host, addr, port, key) -> bool:
        # Reached only when the key is not the whole pinned key.
        self._seen.append(key)
        return bool(self._pin.fingerprint) and key.get_fingerprint("sha256") == self._pin.fingerprint


class Session:
    """One connection; commands run with sudo -n unless the user is root."""

    def __init__(self, conn: asyncssh.SSHClientConnection, host_key: str):
        self.conn = conn
        self.host_key = host_key
        self.root = True

    async def run(self, command: str, *, input: str | None = None, privileged: bool = True,
                  timeout: float = COMMAND_TIMEOUT) -> Result:
        if privileged and not self.root:
            command = "sudo -n sh -c " + shlex.quote(command)
        try:
            done = await asyncio.wait_for(self.conn.run(command, input=input, check=False), timeout)
        except asyncio.TimeoutError:
            return Result(124, "", f"timed out after {timeout:.0f}s: {command[:120]}")
        return Result(done.exit_status if done.exit_status is not None else 255,
                      str(done.stdout or ""), str(done.stderr or ""))

    async def write(self, path: str, data: str, *, mode: str = "0644") -> Result:
        """Write a file atomically (install into place), as root."""
        return await self.run(write_command(path, data, mode=mode))


def write_command(path: str, data: str, *, mode: str = "0644") -> str:
    """A shell command that writes ``data`` to ``path`` atomically (a temporary
    file beside it, then mv), to chain with others in one command: every
    command is a shell started on the node, and some shells start slowly."""
    directory = path.rsplit("/", 1)[0] or "/"
    q = shlex.quote
    encoded = base64.b64encode(data.encode()).decode()
    return (f"(umask 077 && mkdir -p {q(directory)} && tmp=$(mktemp {q(path)}.XXXXXX) && "
            f"printf %s {encoded} | base64 -d > \"$tmp\" && chmod {mode} \"$tmp\" && mv -f \"$tmp\" {q(path)})")


async def session_open(*, host: str, port: int, user: str, pin: Pin) -> Session:
    if not (pin.key_line or pin.fingerprint):
        raise HostKeyMismatch("no pinned host key")
    seen: list = []
    trusted = [asyncssh.import_public_key(pin.key_line)] if pin.key_line else []
    try:
        conn, _client = await asyncio.wait_for(asyncssh.create_connection(
            lambda: _PinnedClient(pin, seen), host, port, username=user,
            # The only keys trusted are the pin: a callable, so that no
            # known_hosts file is ever read.
            known_hosts=lambda _h, _a, _p: (trusted, [], []),
            client_keys=[str(sshkeys.control_plane_key_ensure())],
            agent_path=None, config=[],
        ), CONNECT_TIMEOUT)
    except asyncssh.HostKeyNotVerifiable:
        got = sshkeys.fingerprint(seen[-1].export_public_key("openssh").decode()) if seen else "another key"
        raise HostKeyMismatch(f"{host}:{port} presented host key {got}, not the pinned {pin.describe()}") from None
    except asyncssh.PermissionDenied as exc:
        raise NodeUnreachable(
            f"{user}@{host}:{port} refused the control plane's SSH key ({exc.reason}); put the key from "
            "'llmgw ctl ssh-key' into that user's authorized_keys") from None
    except (OSError, asyncio.TimeoutError, asyncssh.Error) as exc:
        raise NodeUnreachable(f"cannot reach {host}:{port} over SSH: {exc or type(exc).__name__}") from None
    host_key = conn.get_server_host_key().export_public_key("openssh").decode().strip()
    session = Session(conn, host_key)
    if user != "root":
        uid = await session.run("id -u", privileged=False)
        session.root = uid.out.strip() == "0"
    return session


def over_ssh(*, host: str, port: int, user: str, pin: Pin, body):
    """Run ``await body(session)`` on a fresh connection; its result."""

    async def main():
        session = await session_open(host=host, port=port, user=user, pin=pin)
        try:
            return await body(session)
        finally:
            session.conn.close()
            await session.conn.wait_closed()

    return asyncio.run(main())
