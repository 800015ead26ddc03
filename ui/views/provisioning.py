"""Hypervisors and provisioning jobs (of every kind)."""

from __future__ import annotations

from django.contrib import messages
from django.shortcuts import redirect, render

from provisioning import selectors as prov_selectors
from provisioning import services as prov_services
from provisioning.choices import JobStatus, StepStatus
from provisioning.validation import RequestInvalid

from .access import actor, back, operation, viewer

FINISHED_STEPS = {StepStatus.DONE, StepStatus.SKIPPED}
VM_FIELDS = ("node", "hypervisor", "vmid", "ip", "gateway", "cores", "memory", "disk", "nameserver")


def _jobs():
    jobs = list(prov_selectors.job_list().order_by("-created_at")[:50])
    for job in jobs:
        steps = list(job.steps.all())
        done = sum(1 for s in steps if s.status in FINISHED_STEPS)
        job.percent = round(100 * done / len(steps)) if steps else 0
        job.done_steps, job.total_steps = done, len(steps)
        job.current = next((s for s in steps if s.status not in FINISHED_STEPS), None)
        job.active = job.status in (JobStatus.QUEUED, JobStatus.RUNNING)
    return jobs


def _context(**extra) -> dict:
    return {"hypervisors": prov_selectors.hypervisor_list(), "jobs": _jobs(), "form": {}, "errors": {}, **extra}


@viewer("provisioning.view_job", "provisioning.view_hypervisor")
def provisioning_page(request):
    return render(request, "ui/provisioning.html", _context())


@viewer("provisioning.view_job")
def jobs_live(request):
    return render(request, "ui/partials/jobs.html", {"jobs": _jobs()})


def _int(value: str, field: str, errors: dict):
    try:
        return int(value)
    except ValueError:
        errors[field] = "give a whole number"
        return value


@operation("provisioning.run_provisioning")
def job_new_vm(request):
    form = {f: request.POST.get(f, "").strip() for f in VM_FIELDS}
    errors: dict[str, str] = {}
    data = {k: v for k, v in form.items() if v != ""}
    for field in ("vmid", "cores", "memory"):
        if field in data:
            data[field] = _int(data[field], field, errors)
    for field in ("node", "vmid", "ip", "gateway"):
        if field not in data:
            errors[field] = "required"
    if not errors:
        try:
            job = prov_services.job_provision_create(request=data, user=request.user)
        except RequestInvalid as exc:
            errors = dict(exc.errors)
        else:
            messages.success(request, f"Job {job.pk} queued: provision {job.node_name}.")
            return redirect("ui-provisioning")
    return render(request, "ui/provisioning.html", _context(form=form, errors=errors), status=400)


@operation("provisioning.run_provisioning")
def job_retry(request, job_id: int):
    prov_services.job_retry(job_id=job_id, actor=actor(request))
    messages.success(request, f"Job {job_id} queued again: the failed step starts afresh.")
    return back(request)


@operation("provisioning.run_provisioning")
def job_cancel(request, job_id: int):
    prov_services.job_cancel(job_id=job_id, actor=actor(request))
    messages.success(request, f"Job {job_id} cancelled after its current call; what it made stays.")
    return back(request)
