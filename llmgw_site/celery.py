"""The Celery app. Its beat schedule is defined here, in code, and so is the
Redis transport it uses (``Transport`` below, named by settings)."""

import os

from celery import Celery
from kombu.transport import redis

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

app = Celery("llmgw_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_finalize.connect
def _beat_schedule(sender, **_kwargs):
    from django.conf import settings

    sweep = settings.LLMGW_SWEEP_INTERVAL
    sender.conf.beat_schedule = {
        "nodes-sweep-lost": {
            "task": "nodes.tasks.nodes_sweep_lost",
            "schedule": sweep,
            # A sweep that waited longer than its own period is stale: the next
            # one is already on its way.
            "options": {"expires": sweep},
        },
        "replicas-reconcile": {
            "task": "replicas.tasks.replicas_reconcile",
            "schedule": settings.LLMGW_RECONCILE_INTERVAL,
            "options": {"expires": settings.LLMGW_RECONCILE_INTERVAL},
        },
        # Autoscaling: cheap (a few Redis reads per autoscaled model), so short;
        # a gateway that holds a request for a model at zero asks at once too.
        "replicas-autoscale": {
            "task": "replicas.tasks.replicas_autoscale",
            "schedule": settings.LLMGW_AUTOSCALE_INTERVAL,
            "options": {"expires": settings.LLMGW_AUTOSCALE_INTERVAL},
        },
        "provisioning-resume-stalled": {
            "task": "provisioning.tasks.jobs_resume_stalled",
            "schedule": settings.LLMGW_PROVISION_SWEEP_INTERVAL,
            "options": {"expires": settings.LLMGW_PROVISION_SWEEP_INTERVAL},
        },
        # A week's notice of a node certificate that nothing renewed (hourly is plenty);
        # nodes' task: the warning is an Event about the node (pki records no Events).
        "nodes-warn-expiring-certs": {
            "task": "nodes.tasks.certs_warn_expiring",
            "schedule": 3600.0,
            "options": {"expires": 3600.0},
        },
    }


# Celery's Redis transport, surviving the loss of Redis with tasks in flight.
#
# kombu 5.7.0 crashes the whole worker ("Unrecoverable error: AttributeError:
# 'NoneType' object has no attribute 'hostname'") when its connection to Redis
# breaks while an acks_late task runs: closing the channel tries to put the
# unacknowledged messages back through a connection it has just released.
# Nothing is lost by not trying: those messages stay in Redis's unacked set,
# from which kombu restores them after the visibility timeout, and every task
# here is periodic or idempotent (the reconcile reaches the same end anyway).


class Channel(redis.Channel):
    def close(self) -> None:
        if getattr(self.connection, "client", None) is None:
            self.do_restore = False
        super().close()


class Transport(redis.Transport):
    Channel = Channel
