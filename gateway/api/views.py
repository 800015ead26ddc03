from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from accounts.actors import actor
from core.strict import no_body

from .. import selectors, services
from .serializers import ApiKeyCreatedSerializer, ApiKeyCreateSerializer, ApiKeySerializer


class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Keys for /v1. The key itself is in the answer to its creation only."""

    lookup_field = "name"
    serializer_class = ApiKeySerializer
    permission_model = "gateway.apikey"
    required_permissions = {"revoke": ("gateway.change_apikey",)}

    def get_queryset(self):
        return selectors.key_list()

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: ApiKeyCreatedSerializer})
    def create(self, request):
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
