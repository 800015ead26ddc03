"""Every (from, to) pair of the job and step tables, through the one function each."""

import itertools

import pytest
from django.utils import timezone

from core.exceptions import InvalidTransition
from core.models import Event
from provisioning import services
from provisioning.choices import JOB_TRANSITIONS, STEP_TRANSITIONS, JobKind, JobStatus, StepStatus
from provisioning.exceptions import InvalidJobTransition
from provisioning.models import Job, Step

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("old,new", list(itertools.product(JobStatus.values, JobStatus.values)))
def test_job_transition(old, new):
    job = Job.objects.create(kind=JobKind.PROVISION, node_name="n1", status=old, status_changed_at=timezone.now())
    if new in JOB_TRANSITIONS[old]:
        services.job_transition(job_id=job.pk, to=new, reason="because")
        job.refresh_from_db()
        assert job.status == new and job.status_reason == "because"
        assert Event.objects.filter(subject=f"job/{job.pk}", data__to=new).exists()
    else:
        with pytest.raises(InvalidJobTransition):
            services.job_transition(job_id=job.pk, to=new)
        assert Job.objects.get(pk=job.pk).status == old


@pytest.mark.parametrize("old,new", list(itertools.product(StepStatus.values, StepStatus.values)))
def test_step_transition(old, new):
    job = Job.objects.create(kind=JobKind.PROVISION, node_name="n1", status_changed_at=timezone.now())
    step = Step.objects.create(job=job, index=0, name="s", title="S", status=old)
    if new in STEP_TRANSITIONS[old]:
        services.step_transition(step=step, to=new)
        assert Step.objects.get(pk=step.pk).status == new
    else:
        with pytest.raises(InvalidJobTransition):
            services.step_transition(step=step, to=new)
        assert Step.objects.get(pk=step.pk).status == old


def test_the_api_maps_a_refused_transition_to_409():
    # The project's exception handler answers InvalidTransition with 409.
    assert issubclass(InvalidJobTransition, InvalidTransition)


def test_one_active_job_per_node():
    services_job = dict(kind=JobKind.PROVISION, node_name="n1", status_changed_at=timezone.now())
    Job.objects.create(**services_job)
    from django.db import IntegrityError, transaction

    with pytest.raises(IntegrityError), transaction.atomic():
        Job.objects.create(**services_job)
    Job.objects.create(**dict(services_job, status=JobStatus.FAILED))
