from celery import shared_task

from . import reconcile


@shared_task(acks_late=False, ignore_result=True)
def replicas_reconcile() -> None:
    # Not acks_late: a reconcile lost with its worker is replaced by the next one.
    reconcile.replicas_reconcile()
