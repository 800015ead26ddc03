"""Where apps built on replicas plug in, registered from their AppConfig.ready()
(as ``nodes.hooks`` is for replicas).

replicas knows nothing of request routing; a stopping replica still waits
until no request is in flight on it. The routing app answers that here.
"""

from __future__ import annotations

from typing import Callable

# (replica_id=int) -> int: requests in flight on the replica, plus one for
# every router that may still send it one. Summed over the providers.
#
# No provider means no routing app is installed: nothing sends the replica
# requests, so 0 is the truth. A routing app that is installed registers its
# provider in its ready(), importing it at the top of its modules, so a
# provider that fails to load stops the process at start rather than
# reading as "nothing in flight".
inflight_providers: list[Callable[..., int]] = []


def replica_inflight(*, replica_id: int) -> int:
    return sum(provider(replica_id=replica_id) for provider in inflight_providers)
