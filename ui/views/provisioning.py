"""Hypervisors and provisioning jobs (of every kind)."""

from __future__ import annotations

from django.contrib import messages
from django.shortcuts import redirect, render

from provisioning import selectors as prov_selectors
from provisioning import services as prov_services
from provisioning.choices import JobStatus, StepStatus
from provisioning.validation import RequestInvalid

from ..onboard_form import VM_ONBOARD_PREFIX, VM_ONBOARD_TEXT, form_read, vm_onboard_body
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


def page_context(**extra) -> dict:
    """The page, with its two forms: New VM (vm_*) and Add existing machine (add_*)."""
    return {"hypervisors": prov_selectors.hypervisor_list(), "jobs": _jobs(), "vm_form": {}, "vm_errors": {},
            "add_form": {}, "add_errors": {}, "host_key": None, **extra}


@viewer("provisioning.view_job", "provisioning.view_hypervisor")
def provisioning_page(request):
    return render(request, "ui/provisioning.html", page_context())


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
    onboard = form_read(request.POST, VM_ONBOARD_TEXT, ("skip_gpus",), prefix=VM_ONBOARD_PREFIX)
    form["onboard"] = bool(request.POST.get("onboard"))
    form.update({VM_ONBOARD_PREFIX + k: v for k, v in onboard.items()})
    errors: dict[str, str] = {}
    data = {k: v for k, v in form.items() if k in VM_FIELDS and v != ""}
    for field in ("vmid", "cores", "memory"):
        if field in data:
            data[field] = _int(data[field], field, errors)
    for field in ("node", "vmid", "ip", "gateway"):
        if field not in data:
            errors[field] = "required"
    if form["onboard"]:
        data["onboard"] = vm_onboard_body(onboard)
    elif any(onboard.values()):
        # As 'llmgw ctl provision' refuses --fabric without --onboard: what was typed is not dropped silently.
        errors["onboard"] = "the onboarding fields are filled in: tick 'Onboard it when it is made', or empty them"
    if not errors:
        try:
            job = prov_services.job_provision_create(request=data, user=request.user)
        except RequestInvalid as exc:
            errors = dict(exc.errors)
        else:
            then = "; onboarding follows once the VM answers" if form["onboard"] else ""
            messages.success(request, f"Job {job.pk} queued: provision {job.node_name}{then}.")
            return redirect("ui-provisioning")
    return render(request, "ui/provisioning.html", page_context(vm_form=form, vm_errors=errors), status=400)


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
