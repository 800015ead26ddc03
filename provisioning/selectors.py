"""Reads of provisioning."""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet

from .exceptions import JobNotFound
from .models import Hypervisor, Job, Step


def hypervisor_list() -> QuerySet[Hypervisor]:
    return Hypervisor.objects.all()


def job_list(*, status: str | None = None, node: str | None = None, kind: str | None = None) -> QuerySet[Job]:
    jobs = Job.objects.select_related("hypervisor", "created_by").prefetch_related(
        Prefetch("steps", queryset=Step.objects.order_by("index"))
    )
    if status:
        jobs = jobs.filter(status=status)
    if node:
        jobs = jobs.filter(node_name=node)
    if kind:
        jobs = jobs.filter(kind=kind)
    return jobs


def job_get(*, job_id: int) -> Job:
    job = job_list().filter(pk=job_id).first()
    if job is None:
        raise JobNotFound(f"no job {job_id}; 'llmgw ctl jobs' lists them")
    return job


def node_host_key(*, node_name: str) -> str:
    """The SSH host key pinned when llmgw made the node's machine ('' if none)."""
    return (
        Job.objects.filter(node_name=node_name)
        .exclude(ssh_host_key="")
        .order_by("-created_at", "-id")
        .values_list("ssh_host_key", flat=True)
        .first()
        or ""
    )
