from django.db import models

from .choices import EventSeverity


class Event(models.Model):
    """Every decision the control plane makes, in words a person can act on.

    ``kind`` names what happened; the app that records it owns the kind
    (declared in its ``choices.py`` and registered in its ``AppConfig.ready``,
    see ``core.events``), so the column carries no list of choices and no app
    needs another's migration to record one. ``node`` is a lazy reference
    (core imports nothing from nodes): events are listed per node.
    """

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    kind = models.CharField(max_length=32)
    severity = models.CharField(max_length=8, choices=EventSeverity.choices, default=EventSeverity.INFO)
    node = models.ForeignKey("nodes.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="events")
    subject = models.CharField(max_length=128, help_text="what it is about: node/node01, replica/12")
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        # The table it had when it lived in nodes: the rows stayed where they were.
        db_table = "nodes_event"
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.subject}: {self.message}"
