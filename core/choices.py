from django.db import models


class EventSeverity(models.TextChoices):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class CoreEventKind(models.TextChoices):
    # The control plane about itself (its outages, its hearing, who revoked a
    # certificate or an API key): recorded by core and by the apps above it.
    CONTROL_PLANE = "control_plane"
