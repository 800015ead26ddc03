"""The Celery app. Its beat schedule is defined here, in code."""

import os

from celery import Celery

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
        "provisioning-resume-stalled": {
            "task": "provisioning.tasks.jobs_resume_stalled",
            "schedule": settings.LLMGW_PROVISION_SWEEP_INTERVAL,
            "options": {"expires": settings.LLMGW_PROVISION_SWEEP_INTERVAL},
        },
        # A week's notice of a node certificate that nothing renewed (hourly is plenty).
        "pki-warn-expiring": {
            "task": "nodes.tasks.certs_warn_expiring",
            "schedule": 3600.0,
            "options": {"expires": 3600.0},
        },
    }
