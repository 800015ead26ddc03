from celery import shared_task

from . import runner, services


# acks_late: a worker killed mid-advance leaves the message to be redelivered;
# the job's lease and its steps' look-first make a second run harmless.
@shared_task(acks_late=True, ignore_result=True)
def job_advance(job_id: int, wake: int | None = None) -> None:
    runner.job_advance(job_id=job_id, wake=wake)


@shared_task(acks_late=False, ignore_result=True)
def jobs_resume_stalled() -> None:
    # Not acks_late: a sweep lost with its worker is replaced by the next one.
    services.jobs_resume_stalled()
