from drf_spectacular.utils import extend_schema
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from accounts.actors import actor
from core.strict import no_body

from .. import selectors, services
from .serializers import FabricSerializer, NodeSerializer


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = NodeSerializer
    permission_model = "nodes.node"
    required_permissions = {"cordon": ("nodes.change_node",), "uncordon": ("nodes.change_node",)}
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


class FabricViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = FabricSerializer
    permission_model = "nodes.fabric"
    lookup_field = "name"
    # Fabric names may contain dots (the router's default stops at them).
    lookup_value_regex = "[^/]+"

    def get_queryset(self):
        return selectors.fabric_list()
