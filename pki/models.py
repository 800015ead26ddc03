from django.db import models

from .choices import CertificateKind


class Certificate(models.Model):
    """Every certificate the authority issued, the authority's own included."""

    serial = models.CharField(max_length=40, unique=True, help_text="hex")
    common_name = models.CharField(max_length=255, db_index=True)
    kind = models.CharField(max_length=16, choices=CertificateKind.choices)
    not_before = models.DateTimeField()
    not_after = models.DateTimeField()
    fingerprint_sha256 = models.CharField(max_length=64, unique=True)
    subject_alt_names = models.JSONField(default=list, blank=True)
    pem = models.TextField(help_text="the public certificate")
    issued_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revocation_reason = models.CharField(max_length=255, blank=True)

    class Meta:
        ordering = ["-issued_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(kind__in=CertificateKind.values),
                name="%(app_label)s_%(class)s_kind_valid",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.common_name} ({self.serial})"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None
