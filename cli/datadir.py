"""The embedded default's data directory is private to the user running it.

It holds the SQLite database (sessions, operator token hashes, everything),
the secret key, the authority's private key, the admin's first password and
``llmgw ctl``'s token: any other local user who can read it can act as an
admin. ``llmgw up`` and ``llmgw demo`` run with umask 077, so what they and
their children create is private from the start; ``data_dirs_make_private``
takes group and other permissions off whatever an earlier version (or a hand)
left readable, and says which, or names what it cannot change.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

UMASK = 0o077


class DataDirNotPrivate(Exception):
    """Files under the data directory that others may read and that this
    user cannot make private (owned by someone else, immutable, read-only)."""


def _entries(root: Path):
    """root, then every directory and file below it; symbolic links are not
    followed (what they point to is not ours to change)."""
    yield root
    for directory, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            yield Path(directory) / name


def data_dirs_make_private(*, roots: list[Path]) -> list[Path]:
    """Take every group and other permission off ``roots`` and everything
    under them. Returns what was changed; raises ``DataDirNotPrivate``
    naming what could not be. A root that does not exist yet is skipped:
    it will be made under the umask."""
    changed: list[Path] = []
    refused: list[str] = []
    seen: set[Path] = set()
    for root in roots:
        if not root.exists():
            continue
        for path in _entries(root):
            if path in seen:
                continue
            seen.add(path)
            try:
                info = path.lstat()
            except FileNotFoundError:  # gone meanwhile (a SQLite -shm, a broker message)
                continue
            if stat.S_ISLNK(info.st_mode) or not info.st_mode & 0o077:
                continue
            mode = stat.S_IMODE(info.st_mode)
            try:
                os.chmod(path, mode & ~0o077)
            except FileNotFoundError:
                continue
            except OSError as exc:
                refused.append(f"{path} ({stat.filemode(info.st_mode)}, owner uid {info.st_uid}: {exc.strerror})")
                continue
            changed.append(path)
    if refused:
        raise DataDirNotPrivate(
            "these are readable by other users and cannot be made private: " + "; ".join(refused)
            + ". Make them owned by this user (or remove them), then start again"
        )
    return changed
