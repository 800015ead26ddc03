"""The user engines run as: not the agent's root.

Whoever writes the catalog chooses what engines run; the engines' user
bounds what that can do to the node. It is named by ``engine_user`` in
agent.yaml (onboarding and the shipped unit create ``llmgw-engine``, a
system user with no login). A root agent starts every engine with that
user's uid and gid, its own groups, and the groups that own the GPU and
InfiniBand device files, so that CUDA and RDMA keep working. An agent that
is not root cannot change user: its engines run as itself, and it says so
once.
"""

from __future__ import annotations

import glob
import grp
import logging
import os
import pwd
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Device files an engine opens: NVIDIA's (nvidiactl, nvidia0..., nvidia-uvm,
# nvidia-caps), DRM render nodes, and the RDMA verbs devices.
DEVICE_GLOBS = ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/dri/*", "/dev/infiniband/*")


@dataclass(frozen=True)
class EngineUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups
    home: str


def engine_user_problem(name: str, *, as_root: bool) -> str:
    """Why agent.yaml's engine_user cannot be used ('' when it can)."""
    if not name:
        return ""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if not as_root:
            return ""  # not used: a non-root agent runs engines as itself
        return (f"user {name!r} does not exist on this node; create it (useradd --system --no-create-home "
                f"--shell /usr/sbin/nologin {name}) or name another")
    if entry.pw_uid == 0:
        return f"user {name!r} is root (uid 0); engines must run as an unprivileged user"
    return ""


def device_groups(globs: tuple[str, ...] = DEVICE_GLOBS) -> set[int]:
    """The groups owning the GPU and InfiniBand device files (root's excepted:
    joining it would give away far more than a device)."""
    gids = set()
    for pattern in globs:
        for path in glob.glob(pattern):
            try:
                gid = os.stat(path).st_gid
            except OSError:
                continue
            if gid != 0:
                gids.add(gid)
    return gids


def engine_user_resolve(name: str) -> EngineUser | None:
    """Who engines run as: None for the agent's own user (no name given, or
    an agent that is not root)."""
    if os.geteuid() != 0:
        if name:
            logger.warning("engine_user %s is not used: the agent runs as uid %d, not root, and engines run as "
                           "that user", name, os.geteuid())
        return None
    if not name:
        logger.warning("engines run as root: set engine_user in agent.yaml (onboarding writes llmgw-engine) "
                       "so that the catalog cannot run code as root on this node")
        return None
    entry = pwd.getpwnam(name)
    groups = set(os.getgrouplist(name, entry.pw_gid)) | device_groups()
    groups.discard(entry.pw_gid)
    names = ", ".join(sorted(_group_name(g) for g in groups)) or "none"
    logger.info("engines run as user %s (uid %d, gid %d, groups %s)", name, entry.pw_uid, entry.pw_gid, names)
    return EngineUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid, groups=tuple(sorted(groups)),
                      home=entry.pw_dir)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
