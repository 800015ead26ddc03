"""A gateway process's routing table: which replicas serve which model, and
how busy each is. Held in memory, replaced whole when the database changes;
only the event loop's thread touches it."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from yarl import URL

from .metrics import INFLIGHT
from .selectors import RoutingSnapshot

# A replica that refused a connection gets no requests for this long (unless
# it is the model's last), since the database may take a minute to say that
# its node is gone.
EJECT_SECONDS = 5.0


class Route:
    """One ready replica's leader, with this process's requests in flight on it."""

    __slots__ = ("replica_id", "model", "base_url", "label", "_inflight", "down_until", "_urls")

    def __init__(self, replica_id: int, model: str, base_url: str) -> None:
        self.replica_id = replica_id
        self.model = model
        self.base_url = base_url
        self.label = str(replica_id)
        self._inflight = 0
        self.down_until = 0.0
        self._urls: dict[str, URL] = {}

    @property
    def inflight(self) -> int:
        return self._inflight

    @inflight.setter
    def inflight(self, count: int) -> None:
        # Written through to the metrics file, where the other web processes' scrapes read it.
        self._inflight = count
        INFLIGHT.labels(self.model, self.label).set(count)

    def url(self, path: str) -> URL:
        # Parsed once per route and path, not on every request.
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        return url

    def __repr__(self) -> str:
        return f"Route(replica={self.replica_id}, model={self.model}, {self.base_url}, inflight={self.inflight})"


@dataclass(frozen=True)
class Key:
    id: int
    name: str
    allowed_models: frozenset[str] | None

    def allows(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


class RoutingTable:
    def __init__(self) -> None:
        self.catalog: dict[str, int] = {}
        self.by_model: dict[str, list[Route]] = {}
        self.keys: dict[str, Key] = {}
        # Every route this process knows, including ones that left the table
        # while requests were still in flight on them.
        self.routes: dict[int, Route] = {}

    def apply(self, snapshot: RoutingSnapshot) -> None:
        by_model: dict[str, list[Route]] = {}
        current: dict[int, Route] = {}
        for row in snapshot.routes:
            route = self.routes.get(row.replica_id)
            if route is None:
                route = Route(row.replica_id, row.model, row.base_url)
            else:
                # The same object: requests in flight on it decrement its count.
                if route.base_url != row.base_url:
                    route.base_url, route._urls = row.base_url, {}
                route.model = row.model
            current[row.replica_id] = route
            by_model.setdefault(row.model, []).append(route)
        # Keep the departed routes that still carry requests, so that their
        # counts stay visible to a drain until those requests end.
        for replica_id, route in self.routes.items():
            if replica_id not in current and route.inflight > 0:
                current[replica_id] = route
        self.routes = current
        self.by_model = by_model
        self.catalog = dict(snapshot.catalog)
        self.keys = {k.secret_hash: Key(k.id, k.name, k.allowed_models) for k in snapshot.keys}

    def routed_ids(self) -> list[int]:
        return sorted(r.replica_id for routes in self.by_model.values() for r in routes)

    def inflight_counts(self) -> dict[int, int]:
        return {r.replica_id: r.inflight for r in self.routes.values() if r.inflight}

    def ready_models(self) -> list[str]:
        return sorted(self.by_model)

    def pick(self, model: str, exclude: Route | None = None) -> Route | None:
        """The replica of ``model`` with the fewest requests in flight (ties
        broken at random), passing over one that refused a connection lately
        while another is there."""
        routes = self.by_model.get(model)
        if not routes:
            return None
        if len(routes) == 1:
            route = routes[0]
            return None if route is exclude else route
        now = time.monotonic()
        best: list[Route] = []
        best_score = None
        for route in routes:
            if route is exclude:
                continue
            score = (route.down_until > now, route.inflight)
            if best_score is None or score < best_score:
                best, best_score = [route], score
            elif score == best_score:
                best.append(route)
        if not best:
            return None
        return best[0] if len(best) == 1 else random.choice(best)

    def mark_down(self, route: Route) -> None:
        route.down_until = time.monotonic() + EJECT_SECONDS
