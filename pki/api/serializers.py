from rest_framework import serializers

from core.strict import StrictInput

from ..models import Certificate


class CertificateSerializer(serializers.ModelSerializer):
    class Meta:
        model = Certificate
        fields = [
            "serial", "common_name", "kind", "not_before", "not_after", "fingerprint_sha256",
            "subject_alt_names", "issued_at", "revoked_at", "revocation_reason",
        ]


class RevokeSerializer(StrictInput, serializers.Serializer):
    target = serializers.CharField(max_length=255, help_text="a node id (every live client certificate of it) or a serial (hex)")
    reason = serializers.CharField(max_length=255, required=False, allow_blank=True, default="")
