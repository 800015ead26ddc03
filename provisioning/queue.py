"""Enqueueing job advances, by task name (the tasks module imports the runner,
which imports the services that enqueue)."""

from __future__ import annotations

import datetime as dt

from celery import current_app
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from .models import Job

ADVANCE_TASK = "provisioning.tasks.job_advance"


def job_enqueue(*, job_id: int, countdown: float = 0) -> int:
    """Schedule the job's next advance (after commit) and make every earlier
    message for it stale. Returns the new wake value."""
    due = timezone.now() + dt.timedelta(seconds=countdown)
    Job.objects.filter(pk=job_id).update(wake=F("wake") + 1, next_run_at=due)
    wake = Job.objects.values_list("wake", flat=True).get(pk=job_id)
    transaction.on_commit(
        lambda: current_app.send_task(ADVANCE_TASK, args=[job_id, wake], countdown=countdown or None)
    )
    return wake
