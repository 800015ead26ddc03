"""Where apps built on pki plug in, registered from their AppConfig.ready().

pki knows nothing of nodes or their Events; nodes records what pki does
through these lists (as nodes/hooks.py does for the apps above nodes).
Every hook is called with keyword arguments.
"""

from __future__ import annotations

from typing import Callable

# (certificate=Certificate, actor=str, reason=str) -> None, inside the revocation's transaction.
cert_revoked_handlers: list[Callable[..., None]] = []
