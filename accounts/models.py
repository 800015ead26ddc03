from django.conf import settings
from django.db import models


class OperatorToken(models.Model):
    """A token for the operator REST API ('llmgw ctl', scripts). Only its
    SHA-256 is kept; the token itself is shown once, when it is made."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="operator_tokens")
    name = models.CharField(max_length=64, blank=True)
    # The start of the token, to tell tokens apart in lists and logs.
    prefix = models.CharField(max_length=32, unique=True)
    secret_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # Past it the token authenticates no one. None: never (the token 'llmgw up'
    # writes for the first admin, and tokens made before expiry existed).
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["user__username", "created_at"]
        verbose_name = "operator token"

    def __str__(self) -> str:
        return f"{self.prefix}... ({self.user})"
