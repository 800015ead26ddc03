"""The control plane's own SSH key, and the host key a new machine presents."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import asyncssh
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings

KEY_NAME = "id_ed25519"


def key_dir() -> Path:
    return Path(settings.DATA_DIR) / "ssh"


def control_plane_key_ensure() -> Path:
    """The private key's path; an ed25519 key is made (0600) on first use."""
    directory = key_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / KEY_NAME
    if path.exists():
        return path
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "wb") as handle:
        handle.write(private)
    (directory / f"{KEY_NAME}.pub").write_bytes(public + b" llmgw-control-plane\n")
    return path


def control_plane_public_key() -> str:
    path = control_plane_key_ensure()
    pub = path.with_name(f"{KEY_NAME}.pub")
    if not pub.exists():
        key = serialization.load_ssh_private_key(path.read_bytes(), password=None)
        text = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        pub.write_bytes(text + b" llmgw-control-plane\n")
    return pub.read_text().strip()


def tcp_answers(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def host_key_fetch(host: str, port: int, timeout: float) -> str:
    """The host key the SSH server presents, as an OpenSSH public key line."""

    async def fetch():
        return await asyncio.wait_for(asyncssh.get_server_host_key(host, port), timeout)

    # Not asyncio.run: it would wait at the end for a name lookup still hung
    # in the executor's thread, past the timeout (a web request calls this).
    loop = asyncio.new_event_loop()
    try:
        key = loop.run_until_complete(fetch())
    finally:
        loop.close()  # its executor is shut down without waiting
    if key is None:
        raise OSError(f"{host}:{port} presented no host key")
    return key.export_public_key("openssh").decode().strip()


def fingerprint(public_key_line: str) -> str:
    if not public_key_line:
        return ""
    return asyncssh.import_public_key(public_key_line).get_fingerprint("sha256")
