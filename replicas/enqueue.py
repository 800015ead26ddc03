"""Asking a worker to reconcile, once the caller's transaction commits.

The task is sent by name (``celery.current_app.send_task``), as
``provisioning.queue`` sends its jobs: the task module is the top of the app
(it imports the reconciler, which imports the services that ask), so this
module imports nothing of it. Requests are coalesced (``replicas.coalesce``):
however many are made, at most one pass runs and one is owed.
"""

from __future__ import annotations

from celery import current_app
from django.db import transaction

from .coalesce import reconcile_ask, reconcile_gate

RECONCILE_TASK = "replicas.tasks.replicas_reconcile"


def reconcile_after_commit(*, countdown: float = 0) -> None:
    """Ask for a reconcile when the current transaction commits (at once
    outside one); with ``countdown``, for one that starts no sooner."""
    transaction.on_commit(lambda: reconcile_request(countdown=countdown))


def reconcile_request(*, countdown: float = 0) -> None:
    """Ask now. The one place a reconcile is asked for: a test without a
    worker switches enqueueing off by replacing this function."""
    if countdown:
        # Due later: its task marks the pass owed when it runs, not now (a
        # pass starting before then would take a mark set now).
        current_app.send_task(RECONCILE_TASK, countdown=countdown)
        return
    reconcile_ask(
        gate=reconcile_gate(), send=lambda marked: current_app.send_task(RECONCILE_TASK, kwargs={"marked": marked})
    )
