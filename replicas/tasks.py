from celery import shared_task

from . import coalesce, reconcile
from .autoscaling import service as autoscaling


@shared_task(acks_late=False, ignore_result=True)
def replicas_reconcile(*, marked: bool = False) -> None:
    # Not acks_late: a reconcile lost with its worker is replaced by the next one.
    # marked: sent by replicas.enqueue, which marked its pass owed; beat's tick
    # and a delayed request owe theirs now.
    coalesce.reconcile_passes(gate=coalesce.reconcile_gate(), run=reconcile.replicas_reconcile, owe=not marked)


@shared_task(acks_late=False, ignore_result=True)
def replicas_autoscale(*, model: str | None = None) -> None:
    # Every autoscaled model (beat), or one a gateway holds requests for.
    autoscaling.autoscale_tick(model_name=model)
