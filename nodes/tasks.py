from celery import shared_task

from . import certificates, sweep


@shared_task(acks_late=False, ignore_result=True)
def nodes_sweep_lost() -> list[str]:
    # Not acks_late: a sweep lost with its worker is replaced by the next one.
    return sweep.nodes_sweep_lost()


@shared_task(ignore_result=True)
def certs_warn_expiring() -> None:
    certificates.certs_warn_expiring()
