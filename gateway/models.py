from django.core.validators import RegexValidator
from django.db import models

KEY_NAME = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
    "a key name is 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
)


class ApiKey(models.Model):
    """A client's key for /v1. Only its SHA-256 is kept; the key itself is
    shown once, when it is created."""

    name = models.CharField(max_length=64, unique=True, validators=[KEY_NAME])
    # The start of the key (``sk-llmgw-ab12cd34``), to tell keys apart in lists and logs.
    prefix = models.CharField(max_length=32, unique=True)
    secret_hash = models.CharField(max_length=64, unique=True)
    # Model names this key may use; empty means every model.
    allowed_models = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Changed by create and revoke only (the gateways reload their key cache
    # when it moves); the usage counters are written with update().
    updated_at = models.DateTimeField(auto_now=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Usage, added in batches by each gateway process.
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return self.name

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


class GatewayProcess(models.Model):
    """What one gateway process is doing, published every fraction of a
    second on the embedded default (production keeps it in Redis): the
    replicas it routes to and its requests in flight on each."""

    name = models.CharField(max_length=128, unique=True)
    seen_at = models.DateTimeField()
    routes = models.JSONField(default=list)
    inflight = models.JSONField(default=dict)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "gateway processes"

    def __str__(self) -> str:
        return self.name
