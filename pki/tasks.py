from celery import shared_task

from . import rotation


@shared_task(ignore_result=True)
def certs_warn_expiring() -> None:
    rotation.certs_warn_expiring()
