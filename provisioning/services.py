"""Writes to provisioning: hypervisors, jobs and their steps."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from core.choices import EventSeverity
from core.events import event_record
from core.statemachine import StateMachine

from . import queue, stepkit
from .choices import ACTIVE, JOB_TRANSITIONS, STEP_TRANSITIONS, JobKind, JobStatus, ProvisioningEventKind, StepStatus
from .exceptions import InvalidJobTransition, JobNotFound, StepFailed
from .models import Hypervisor, Job, Step
from .onboard.request import onboard_request_check
from .proxmox import Proxmox, ProxmoxError, needed_privileges
from .validation import RequestInvalid, hypervisor_fields_check, hypervisor_secret_check, provision_request_check
from .vault import secret_encrypt

logger = logging.getLogger(__name__)

HYPERVISOR_FIELDS = ("url", "token_id", "ca_pem", "node", "storage", "image", "bridge", "pool", "ciuser",
                     "nameserver", "ssh_keys")


# --- hypervisors -------------------------------------------------------------


def hypervisor_create(*, name: str, token_secret: str, actor: str, **fields: Any) -> Hypervisor:
    hypervisor_fields_check({"name": name, **fields})
    if not token_secret.strip():
        raise RequestInvalid({"token_secret": "the API token's secret is required"})
    if Hypervisor.objects.filter(name=name).exists():
        raise RequestInvalid({"name": f"a hypervisor named {name!r} exists"})
    data = {k: v for k, v in fields.items() if k in HYPERVISOR_FIELDS and v is not None}
    row = Hypervisor.objects.create(name=name, token_secret_encrypted=secret_encrypt(token_secret.strip()), **data)
    event_record(kind=ProvisioningEventKind.PROVISIONING, subject=f"hypervisor/{name}", data={"actor": actor},
                 message=f"hypervisor {name} added by {actor} ({row.url}, token {row.token_id})")
    return row


def hypervisor_update(*, name: str, actor: str, token_secret: str | None = None, **fields: Any) -> Hypervisor:
    hypervisor_fields_check(fields)
    secret = (token_secret or "").strip()
    with transaction.atomic():
        row = Hypervisor.objects.select_for_update().filter(name=name).first()
        if row is None:
            raise JobNotFound(f"no hypervisor named {name!r}")
        changed = [key for key, value in fields.items()
                   if key in HYPERVISOR_FIELDS and value is not None and value != getattr(row, key)]
        # The token's secret goes wherever url and ca_pem say: whoever moves
        # them must hold the secret, or they could have it sent to themselves.
        hypervisor_secret_check(changed=changed, token_secret=secret)
        for key in changed:
            setattr(row, key, fields[key])
        if secret:
            row.token_secret_encrypted = secret_encrypt(secret)
            changed.append("token_secret")
        if not changed:
            return row
        row.save()
        # Names of fields only: a CA or a key list is long, a secret is secret.
        shown = ", ".join(f"{key}={getattr(row, key)}" if key in ("url", "token_id", "node", "storage", "image",
                                                                  "bridge", "pool", "ciuser", "nameserver")
                          else key for key in changed)
        event_record(kind=ProvisioningEventKind.PROVISIONING, subject=f"hypervisor/{name}",
                     data={"actor": actor, "fields": changed},
                     message=f"hypervisor {name} changed by {actor}: {shown}")
    return row


def hypervisor_delete(*, name: str, actor: str) -> None:
    row = Hypervisor.objects.filter(name=name).first()
    if row is None:
        raise JobNotFound(f"no hypervisor named {name!r}")
    if row.jobs.filter(status__in=ACTIVE).exists():
        raise InvalidJobTransition(f"hypervisor {name} has jobs running; cancel them first")
    row.jobs.update(hypervisor=None)
    row.delete()
    event_record(kind=ProvisioningEventKind.PROVISIONING, subject=f"hypervisor/{name}", data={"actor": actor},
                 message=f"hypervisor {name} removed by {actor}")


def hypervisor_check(*, name: str, vmid: int | None = None) -> dict[str, Any]:
    """Log in with the token and say which of the privileges a job needs it lacks."""
    row = Hypervisor.objects.filter(name=name).first()
    if row is None:
        raise JobNotFound(f"no hypervisor named {name!r}; 'llmgw ctl hypervisors' lists them")
    try:
        api = Proxmox(row)
        version = api.version().get("version", "")
        missing = privileges_missing(api, row, vmid=vmid)
    except ProxmoxError as exc:
        return {"name": name, "reachable": False, "error": str(exc), "version": "", "missing": []}
    return {"name": name, "reachable": True, "error": "", "version": version,
            "missing": [{"privilege": p.name, "path": p.path} for p in missing]}


def privileges_missing(api: Proxmox, hypervisor: Hypervisor, *, vmid: int | None = None) -> list:
    held_by_path: dict[str, set[str]] = {}
    missing = []
    for privilege in needed_privileges(hypervisor, vmid):
        if privilege.path not in held_by_path:
            held_by_path[privilege.path] = api.permissions(privilege.path)
        if privilege.name not in held_by_path[privilege.path]:
            missing.append(privilege)
    return missing


# --- status changes ----------------------------------------------------------


class JobStates(StateMachine):
    noun = "job"
    table = JOB_TRANSITIONS
    error = InvalidJobTransition
    event_kind = ProvisioningEventKind.PROVISIONING

    def subject(self, job: Job) -> str:
        return f"job/{job.pk}"

    def message(self, job: Job, previous: str, to: str, reason: str) -> str:
        return f"{job.kind} {job.node_name}: " + super().message(job, previous, to, reason)

    def data(self, job: Job, previous: str, to: str) -> dict[str, Any]:
        return {**super().data(job, previous, to), "job": job.pk}

    def changing(self, job: Job, previous: str, to: str) -> list[str]:
        job.finished_at = job.status_changed_at if to in FINISHED else None
        if to not in ACTIVE:
            job.lease_owner, job.lease_until, job.next_run_at = "", None, None
        return ["finished_at", "lease_owner", "lease_until", "next_run_at"]


JOB_STATES = JobStates()
FINISHED = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


def job_transition(*, job_id: int, to: str, reason: str = "", expected: str | None = None) -> Job | None:
    """The one place a job's status changes. With expected: compare-and-set
    (None when the job is no longer in that status)."""
    return JOB_STATES.transition(
        Job.objects.filter(pk=job_id), to=to, reason=reason, expected=expected,
        severity=EventSeverity.ERROR if to == JobStatus.FAILED else EventSeverity.INFO,
        missing=JobNotFound(f"no job {job_id}; 'llmgw ctl jobs' lists them"),
    )


def step_transition(*, step: Step, to: str, lines: list[dict[str, str]] = (), data: dict | None = None) -> Step:
    """The one place a step's status changes; the caller holds the job's row lock or lease."""
    if to not in STEP_TRANSITIONS.get(step.status, set()):
        raise InvalidJobTransition(f"step {step.name} of job {step.job_id} is {step.status}; it cannot become {to}")
    now = timezone.now()
    step.status = to
    if to == StepStatus.RUNNING:
        step.started_at = step.started_at or now
        step.finished_at = None
    elif to in (StepStatus.DONE, StepStatus.SKIPPED, StepStatus.FAILED):
        step.finished_at = now
    step.log = list(step.log) + list(lines)
    if data is not None:
        step.data = data
    step.save(update_fields=["status", "started_at", "finished_at", "log", "data"])
    return step


# --- jobs --------------------------------------------------------------------


def job_provision_create(*, request: dict[str, Any], user=None) -> Job:
    """A provisioning job, queued. RequestInvalid (by field) for bad input."""
    clean = provision_request_check(request)
    hypervisor = Hypervisor.objects.get(name=clean.pop("hypervisor"))
    node = clean.pop("node")
    if request.get("onboard") is not None:
        # Checked now, so that a bad onboarding request is refused before a VM is made.
        onboard = dict(request["onboard"])
        onboard_request_check({**onboard, "node": node, "addr": clean["ip"].split("/")[0]})
        clean["onboard"] = onboard
    try:
        with transaction.atomic():
            job = Job.objects.create(
                kind=JobKind.PROVISION, node_name=node, hypervisor=hypervisor, params=clean,
                status=JobStatus.QUEUED, status_changed_at=timezone.now(),
                created_by=user if user is not None and user.is_authenticated else None,
            )
            stepkit.job_steps_create(job)
            event_record(kind=ProvisioningEventKind.PROVISIONING, subject=f"job/{job.pk}",
                         message=f"provision {node} on {hypervisor.name} (VMID {clean['vmid']}, {clean['ip']}) queued"
                         + (f" by {user.get_username()}" if job.created_by else ""))
            queue.job_enqueue(job_id=job.pk)
    except IntegrityError:
        raise RequestInvalid({"node": f"a job for {node} is already running; 'llmgw ctl jobs' shows it"}) from None
    return job


def job_retry(*, job_id: int, actor: str = "") -> Job:
    with transaction.atomic():
        job = job_transition(job_id=job_id, to=JobStatus.QUEUED, reason=f"retried by {actor or 'an operator'}")
        for step in job.steps.select_for_update().filter(status__in=[StepStatus.FAILED, StepStatus.RUNNING]):
            # The failed step starts afresh: it looks at the world again.
            step_transition(step=step, to=StepStatus.PENDING, lines=[log_line("retried")], data={})
        queue.job_enqueue(job_id=job_id)
    return job


def job_cancel(*, job_id: int, actor: str = "") -> Job:
    """Stop the job after its current call; what it made stays (the VM is not removed)."""
    with transaction.atomic():
        job = job_transition(job_id=job_id, to=JobStatus.CANCELLED, reason=f"cancelled by {actor or 'an operator'}")
        for step in job.steps.select_for_update().filter(status=StepStatus.RUNNING):
            step_transition(step=step, to=StepStatus.PENDING, lines=[log_line("cancelled by an operator")])
    return job


def jobs_resume_stalled() -> list[int]:
    """Level-triggered: active jobs whose next advance is overdue and whose
    lease has expired (their worker died) are enqueued again."""
    now = timezone.now()
    grace = dt.timedelta(seconds=settings.LLMGW_PROVISION_STALL_GRACE)
    stalled = list(
        Job.objects.filter(status__in=ACTIVE)
        .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
        .filter(Q(next_run_at__isnull=True) | Q(next_run_at__lt=now - grace))
        .values_list("pk", flat=True)
    )
    for job_id in stalled:
        with transaction.atomic():
            logger.warning("job=%s stalled (its worker died?): enqueued again", job_id)
            queue.job_enqueue(job_id=job_id)
    return stalled


def log_line(text: str) -> dict[str, str]:
    return {"at": timezone.now().isoformat(timespec="seconds"), "line": text}


def job_host_key_pin(*, job_id: int, host_key: str) -> str:
    """Pin the host key the new machine presented. A different key from an
    earlier attempt of the same job is refused, not replaced."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.ssh_host_key and job.ssh_host_key != host_key:
            raise StepFailed(f"the VM presented a different host key than the one pinned earlier ({host_key[:40]}...)")
        job.ssh_host_key = host_key
        job.save(update_fields=["ssh_host_key"])
    return host_key
