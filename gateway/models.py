from django.core.validators import RegexValidator
from django.db import models

from .choices import Priority

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
    # Limits (gateway/limits.py), enforced across every gateway process through
    # Redis; null: none. Tokens are prompt + completion as the engines report them.
    rpm = models.PositiveIntegerField(null=True, blank=True, help_text="requests per minute")
    tpm = models.PositiveIntegerField(null=True, blank=True, help_text="tokens per minute")
    max_concurrent = models.PositiveIntegerField(null=True, blank=True, help_text="requests in flight at once")
    daily_tokens = models.PositiveBigIntegerField(null=True, blank=True, help_text="token budget per UTC day")
    monthly_tokens = models.PositiveBigIntegerField(null=True, blank=True, help_text="token budget per UTC month")
    expires_at = models.DateTimeField(null=True, blank=True)
    priority = models.CharField(max_length=16, choices=Priority.choices, default=Priority.STANDARD)

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


class KeyUsage(models.Model):
    """A key's usage of one model in one hour (UTC), as the engines reported
    it: added in batches by every gateway process, never a write per request."""

    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="hourly_usage")
    model = models.CharField(max_length=128)
    hour = models.DateTimeField()
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["hour", "key", "model"]
        constraints = [
            models.UniqueConstraint(fields=["key", "model", "hour"], name="%(app_label)s_%(class)s_unique_hour"),
        ]

    def __str__(self) -> str:
        return f"{self.key_id}/{self.model}@{self.hour:%Y-%m-%d %H}"
