from rest_framework import serializers

from ..models import Event


class EventSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)

    class Meta:
        model = Event
        fields = ["id", "created_at", "kind", "severity", "subject", "node", "message", "data"]
