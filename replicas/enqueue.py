"""Asking a worker to reconcile, once the caller's transaction commits."""

from __future__ import annotations

from django.db import transaction


def reconcile_after_commit(*, countdown: float = 0) -> None:
    # Late-bound, the one import of its kind in replicas: the task module is
    # the top of the app (it imports the reconciler, which imports the services
    # that call this), so importing it at module level here would be a cycle.
    from . import tasks

    if countdown:
        transaction.on_commit(lambda: tasks.replicas_reconcile.apply_async(countdown=countdown))
    else:
        transaction.on_commit(lambda: tasks.replicas_reconcile.delay())
