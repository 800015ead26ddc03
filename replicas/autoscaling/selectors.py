"""Reads for the autoscaler's readers (the gateway's held requests, the UI)."""

from __future__ import annotations

from ..models import CatalogEntry
from .policy import Policy, policy_of


def autoscaled_hold_limits() -> dict[str, tuple[int, float]]:
    """{model: (requests a gateway process holds at most, seconds each waits at most)}
    for every autoscaled model: the ones whose requests are held rather than refused."""
    out = {}
    for name, stored in CatalogEntry.objects.exclude(autoscale=None).filter(removing=False).values_list(
            "name", "autoscale"):
        policy = policy_of(stored)
        if policy is not None:
            out[name] = (policy.hold_max, policy.hold_wait)
    return out


def autoscaled_policies() -> dict[str, Policy]:
    return {name: policy_of(stored) for name, stored in
            CatalogEntry.objects.exclude(autoscale=None).filter(removing=False).values_list("name", "autoscale")}
