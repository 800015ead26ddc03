"""Per-model timeouts of the gateway's requests to engines.

Four, each in seconds, each set per model in the catalog (``timeouts:``) or
by default in settings, 0 meaning none:

- ``connect``: to open a connection to a replica (then tried on another);
- ``ttft``: from sending a streamed request to its first chunk (then tried on
  another replica: no byte has reached the client yet);
- ``idle``: the longest silence between two chunks of a stream;
- ``total``: the whole exchange, streamed or not.

A non-streamed answer arrives whole at the end of its generation, so only
``total`` bounds it; by default there is no total, so a long generation is
never cut off (the cut-offs at 120 s, 300 s and 10 s of silence that other
gateways' users report).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

FIELDS = ("connect", "ttft", "idle", "total")


@dataclass(frozen=True)
class Timeouts:
    connect: float
    ttft: float
    idle: float
    total: float

    @classmethod
    def of(cls, overrides: dict | None) -> "Timeouts":
        values = defaults()
        for name, value in (overrides or {}).items():
            if name in FIELDS and value is not None:
                values[name] = float(value)
        return cls(values["connect"], values["ttft"], values["idle"], values["total"])


def defaults() -> dict[str, float]:
    return {"connect": settings.LLMGW_GATEWAY_CONNECT_TIMEOUT, "ttft": settings.LLMGW_GATEWAY_TTFT_TIMEOUT,
            "idle": settings.LLMGW_GATEWAY_READ_TIMEOUT, "total": settings.LLMGW_GATEWAY_TOTAL_TIMEOUT}
