from rest_framework import serializers

from ..models import Certificate


class CertificateSerializer(serializers.ModelSerializer):
    class Meta:
        model = Certificate
        fields = [
            "serial", "common_name", "kind", "not_before", "not_after", "fingerprint_sha256",
            "subject_alt_names", "issued_at", "revoked_at", "revocation_reason",
        ]
