"""The step runner: advances a job by running its next steps.

One advance runs steps one after another until a step waits, fails or the
job ends. Waiting never holds a worker for long: the advance records when to
come back and the task is scheduled again with a countdown (a step may first
look for a few seconds in place, as onboarding's first heartbeat does). A lease on the job row keeps
two workers off one job; a worker killed mid-step lets the lease expire and
``services.jobs_resume_stalled`` enqueues the job again. No row lock is held
during a step's network I/O.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from . import queue, services, stepkit
from .choices import ACTIVE, STEP_FINISHED, JobStatus, StepStatus
from .exceptions import StepFailed
from .models import Job, Step

logger = logging.getLogger(__name__)


def _lease_take(*, job_id: int, wake: int | None, owner: str) -> bool:
    now = timezone.now()
    rows = Job.objects.filter(pk=job_id, status__in=ACTIVE).filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
    if wake is not None:
        rows = rows.filter(wake=wake)
    return bool(rows.update(lease_owner=owner, lease_until=now + dt.timedelta(seconds=settings.LLMGW_PROVISION_LEASE)))


def _lease_renew(*, job_id: int, owner: str) -> bool:
    until = timezone.now() + dt.timedelta(seconds=settings.LLMGW_PROVISION_LEASE)
    return bool(Job.objects.filter(pk=job_id, lease_owner=owner, status__in=ACTIVE).update(lease_until=until))


def _lease_release(*, job_id: int, owner: str) -> None:
    Job.objects.filter(pk=job_id, lease_owner=owner).update(lease_owner="", lease_until=None)


def _locked_if_ours(job_id: int, owner: str) -> Job | None:
    """The job row, locked, if this advance still holds its lease and it is active."""
    job = Job.objects.select_for_update().filter(pk=job_id).first()
    if job is None or job.lease_owner != owner or job.status not in ACTIVE:
        return None
    return job


def job_advance(*, job_id: int, wake: int | None = None) -> None:
    owner = uuid.uuid4().hex
    if not _lease_take(job_id=job_id, wake=wake, owner=owner):
        logger.debug("job=%s wake=%s: stale message or another worker has it", job_id, wake)
        return
    try:
        while _advance_one(job_id=job_id, owner=owner):
            if not _lease_renew(job_id=job_id, owner=owner):
                return
    finally:
        _lease_release(job_id=job_id, owner=owner)


def _advance_one(*, job_id: int, owner: str) -> bool:
    """Run the job's next step. True when the next step may run at once."""
    job = Job.objects.select_related("hypervisor").get(pk=job_id)
    if job.status == JobStatus.QUEUED:
        services.job_transition(job_id=job_id, to=JobStatus.RUNNING, expected=JobStatus.QUEUED)
    step = job.steps.exclude(status__in=STEP_FINISHED).order_by("index").first()
    if step is None:
        if services.job_transition(job_id=job_id, to=JobStatus.SUCCEEDED, expected=JobStatus.RUNNING):
            stepkit.kind_followup(job)
        return False
    if step.status == StepStatus.PENDING:
        with transaction.atomic():
            if _locked_if_ours(job_id, owner) is None:
                return False
            services.step_transition(step=step, to=StepStatus.RUNNING)
    spec = stepkit.kind_steps(job.kind)[step.index]
    context = stepkit.StepContext(job=job, step=step, data=dict(step.data))
    failure = None
    outcome = None
    try:
        outcome = spec.run(context)
    except StepFailed as exc:
        failure = str(exc)
    except Exception as exc:  # noqa: BLE001 - a job must end with a reason, never hang as running
        logger.exception("job=%s step=%s crashed", job_id, step.name)
        failure = f"{type(exc).__name__}: {exc}"
    return _record(job_id=job_id, owner=owner, step=step, context=context, outcome=outcome, failure=failure)


def _record(*, job_id, owner, step: Step, context: stepkit.StepContext, outcome, failure: str | None) -> bool:
    with transaction.atomic():
        job = _locked_if_ours(job_id, owner)
        if job is None:
            # Cancelled meanwhile, or the lease expired and another worker
            # took over: what this run learnt is dropped; the steps re-look.
            return False
        step.refresh_from_db()
        lines = context.lines
        if failure is not None:
            lines = lines + [services.log_line(failure)]
            services.step_transition(step=step, to=StepStatus.FAILED, lines=lines, data=context.data)
            services.job_transition(job_id=job_id, to=JobStatus.FAILED, reason=f"{step.title}: {failure}")
            logger.warning("job=%s step=%s failed: %s", job_id, step.name, failure)
            return False
        if isinstance(outcome, stepkit.Wait):
            if outcome.note:
                lines = lines + [services.log_line(outcome.note)]
            step.log = list(step.log) + lines
            step.data = context.data
            step.save(update_fields=["log", "data"])
            job.lease_owner, job.lease_until = "", None
            job.save(update_fields=["lease_owner", "lease_until"])
            queue.job_enqueue(job_id=job_id, countdown=outcome.seconds)
            return False
        if outcome.note:
            lines = lines + [services.log_line(outcome.note)]
        to = StepStatus.SKIPPED if isinstance(outcome, stepkit.Skipped) else StepStatus.DONE
        services.step_transition(step=step, to=to, lines=lines, data=context.data)
        logger.info("job=%s step=%s %s", job_id, step.name, to)
        return True
