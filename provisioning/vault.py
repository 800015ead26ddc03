"""Hypervisor token secrets, encrypted at rest with a key kept beside the PKI.

The key file is created 0600 from the start (never chmodded after), so there
is no moment at which another user could read it.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings

KEY_FILE = "provisioning-secrets.key"


class SecretUnreadable(Exception):
    pass


def key_path() -> Path:
    return Path(settings.PKI_DIR) / KEY_FILE


def _key_load_or_create(path: Path) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes().strip()
    key = Fernet.generate_key()
    with os.fdopen(fd, "wb") as handle:
        handle.write(key)
    return key


@lru_cache(maxsize=4)
def _fernet(path: str) -> Fernet:
    return Fernet(_key_load_or_create(Path(path)))


def secret_encrypt(plain: str) -> str:
    return _fernet(str(key_path())).encrypt(plain.encode()).decode()


def secret_decrypt(token: str) -> str:
    try:
        return _fernet(str(key_path())).decrypt(token.encode()).decode()
    except InvalidToken as exc:
        raise SecretUnreadable(
            f"the stored token secret cannot be decrypted with {key_path()}: was the key file replaced? "
            "Store the secret again ('llmgw ctl hypervisors set-secret')"
        ) from exc
