from celery import shared_task

from . import sweep


@shared_task(acks_late=False, ignore_result=True)
def nodes_sweep_lost() -> list[str]:
    # Not acks_late: a sweep lost with its worker is replaced by the next one.
    return sweep.nodes_sweep_lost()
