from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from accounts.actors import actor
from core.strict import no_body

from .. import gpus, selectors, services
from .serializers import FabricSerializer, GpuHealthSerializer, GpuSerializer, NodeSerializer


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = NodeSerializer
    permission_model = "nodes.node"
    required_permissions = {"cordon": ("nodes.change_node",), "uncordon": ("nodes.change_node",),
                            "gpu_clear": ("nodes.change_node",)}
    lookup_field = "name"
    lookup_value_regex = "[^/]+"

    def get_queryset(self):
        return selectors.node_list()

    def get_serializer_context(self):
        context = super().get_serializer_context()
        if self.action in ("list", "retrieve", "cordon", "uncordon"):
            context["last_seen"] = selectors.node_last_seen(self.get_queryset())
            context["replica_counts"] = selectors.node_replica_counts()
            context["gpu_conflicts"] = selectors.node_gpu_conflicts()
        return context

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    @no_body
    def cordon(self, request, name=None):
        services.node_cordon(node_name=name, actor=actor(request))
        return Response(self.get_serializer(selectors.node_get(name=name)).data)

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    @no_body
    def uncordon(self, request, name=None):
        services.node_uncordon(node_name=name, actor=actor(request))
        return Response(self.get_serializer(selectors.node_get(name=name)).data)


    @extend_schema(request=None, responses=GpuSerializer)
    @action(detail=True, methods=["post"], url_path=r"gpus/(?P<index>[0-9]{1,4})/clear")
    def gpu_clear(self, request, name=None, index=None):
        """Put a quarantined GPU back in service (operators; an Event names who)."""
        gpu = gpus.gpu_clear(node_name=name, index=int(index), actor=actor(request))
        return Response(GpuSerializer(gpu).data)


class GpuHealthViewSet(viewsets.ViewSet):
    """Every GPU's health and latest readings (``?node=NAME`` for one node's)."""

    permission_model = "nodes.node"

    @extend_schema(parameters=[OpenApiParameter("node", str, description="only this node's GPUs")],
                   responses=GpuHealthSerializer(many=True))
    def list(self, request):
        node = request.query_params.get("node") or None
        return Response(GpuHealthSerializer(selectors.gpu_health_list(node_name=node), many=True).data)


class FabricViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = FabricSerializer
    permission_model = "nodes.fabric"
    lookup_field = "name"
    # Fabric names may contain dots (the router's default stops at them).
    lookup_value_regex = "[^/]+"

    def get_queryset(self):
        return selectors.fabric_list()
