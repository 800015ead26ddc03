from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from accounts.actors import actor
from core.strict import no_body

from .. import selectors, services
from .serializers import (ApiKeyCreatedSerializer, ApiKeyCreateSerializer, ApiKeySerializer, ApiKeySettingsSerializer,
                          KeyUsageSerializer)


class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Keys for /v1. The key itself is in the answer to its creation only."""

    lookup_field = "name"
    serializer_class = ApiKeySerializer
    permission_model = "gateway.apikey"
    required_permissions = {"revoke": ("gateway.change_apikey",), "partial_update": ("gateway.change_apikey",),
                            "usage": ("gateway.view_apikey",)}
    http_method_names = ["get", "post", "patch", "head", "options"]

    @extend_schema(request=ApiKeySettingsSerializer, responses=ApiKeySerializer)
    def partial_update(self, request, name=None):
        """Change a key's limits, expiry or priority: only the fields sent (null removes a limit or the expiry)."""
        serializer = ApiKeySettingsSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        row = services.key_update(name=name, **serializer.validated_data, actor=actor(request))
        return Response(ApiKeySerializer(row).data)

    @extend_schema(parameters=[
        OpenApiParameter("key", str, description="one key's usage only"),
        OpenApiParameter("model", str, description="one model's usage only"),
        OpenApiParameter("hours", int, description="the last N hours (default 24, at most 2,232 = 93 days)"),
    ], responses=KeyUsageSerializer(many=True))
    @action(detail=False, methods=["get"])
    def usage(self, request):
        """Usage per key, model and hour (UTC), as the engines reported it."""
        try:
            hours = int(request.query_params.get("hours", 24))
        except ValueError:
            raise ValidationError({"hours": "a whole number of hours, e.g. 24"}) from None
        if not 1 <= hours <= selectors.USAGE_HOURS_MAX:
            raise ValidationError({"hours": f"between 1 and {selectors.USAGE_HOURS_MAX}"})
        rows = selectors.key_usage(key=request.query_params.get("key") or None,
                                   model=request.query_params.get("model") or None, hours=hours)
        return Response(KeyUsageSerializer(rows, many=True).data)

    def get_queryset(self):
        return selectors.key_list()

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: ApiKeyCreatedSerializer})
    def create(self, request):
        """Create a key; settings not sent take the deployment's defaults (null: none). The key is in this
        answer only."""
        serializer = ApiKeyCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        created = services.key_create(**serializer.validated_data, actor=actor(request))
        data = ApiKeySerializer(created.row).data
        data["key"] = created.key
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=ApiKeySerializer)
    @action(detail=True, methods=["post"])
    @no_body
    def revoke(self, request, name=None):
        return Response(ApiKeySerializer(services.key_revoke(name=name, actor=actor(request))).data)
