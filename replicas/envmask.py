"""Secret values in a model's environment (``HF_TOKEN``): write-only.

A variable is secret when its name ends in ``_TOKEN``, ``_KEY`` or
``_SECRET``, or holds ``PASSWORD`` (any case). Its value reaches the engines
(the agents' desired state) and nothing else: the API, the pages and the
admin show it as ``MASK``. Applying a catalog whose secret value is ``MASK``
keeps the stored value (so an exported catalog applies again unchanged); a
new model, or a name with no stored value, must give the value itself.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "********"
SECRET_NAME_RE = re.compile(r"(_TOKEN|_KEY|_SECRET)$|PASSWORD", re.IGNORECASE)


def env_is_secret(name: str) -> bool:
    return bool(SECRET_NAME_RE.search(name))


def env_masked(env: dict[str, Any] | None) -> dict[str, Any]:
    """The environment as it is shown to people."""
    return {k: (MASK if env_is_secret(k) and v not in ("", None) else v) for k, v in (env or {}).items()}


def env_unmask(*, new: dict[str, Any] | None, old: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """``new`` with each masked secret replaced by its stored value; and the
    names that were sent masked but have no stored value to keep."""
    old = old or {}
    merged, missing = {}, []
    for name, value in (new or {}).items():
        if value == MASK and env_is_secret(name):
            if name in old and old[name] != MASK:
                merged[name] = old[name]
                continue
            missing.append(name)
        merged[name] = value
    return merged, missing
