from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.actors import actor
from core.strict import no_body

from .. import catalog, drain, rollout, selectors
from .serializers import (
    CatalogApplySerializer,
    DrainCreateSerializer,
    DrainSerializer,
    ModelSerializer,
    ModelWriteSerializer,
    ReplicaSerializer,
    RolloutStatusSerializer,
    ScaleSerializer,
)


def _catalog_error(exc: catalog.CatalogInvalid) -> Response:
    return Response({"detail": "the catalog was not changed: " + "; ".join(exc.errors), "errors": exc.errors},
                    status=status.HTTP_400_BAD_REQUEST)


class ModelViewSet(viewsets.ModelViewSet):
    """The catalog. Writes go through the same service as 'llmgw ctl apply'."""

    lookup_field = "name"
    lookup_value_regex = "[^/]+"
    permission_model = "replicas.catalogentry"
    # Creating is an upsert, as 'llmgw ctl apply' is.
    required_permissions = {
        "create": ("replicas.add_catalogentry", "replicas.change_catalogentry"),
        "scale": ("replicas.change_catalogentry",),
        "rollout_status": ("replicas.view_catalogentry",),
        # Steering a rollout is operating the model.
        "rollout_pause": ("replicas.change_catalogentry",),
        "rollout_resume": ("replicas.change_catalogentry",),
        "rollout_undo": ("replicas.change_catalogentry",),
    }

    def get_queryset(self):
        return selectors.model_list()

    def get_serializer_class(self):
        return ModelWriteSerializer if self.action in ("create", "update", "partial_update") else ModelSerializer

    def _upsert(self, data):
        try:
            catalog.catalog_upsert(entry=data, admin=self.request.user.has_perm("replicas.trust_engine_code"))
        except catalog.CatalogInvalid as exc:
            return _catalog_error(exc)
        model = self.get_queryset().get(name=data["name"])
        return Response(ModelSerializer(model).data)

    @extend_schema(responses=ModelSerializer)
    def create(self, request, *args, **kwargs):
        response = self._upsert(request.data)
        if response.status_code == 200:
            response.status_code = status.HTTP_201_CREATED
        return response

    @extend_schema(responses=ModelSerializer)
    def update(self, request, *args, **kwargs):
        current = ModelSerializer(self.get_object()).data
        data = {k: current[k] for k in ModelWriteSerializer.Meta.fields}
        for alias, name in ModelWriteSerializer.strict_aliases.items():
            if alias in request.data:
                data.pop(name, None)  # the body names the field by its alias
        data.update(request.data)
        data["name"] = kwargs["name"]
        return self._upsert(data)

    def destroy(self, request, *args, **kwargs):
        catalog.model_remove(name=kwargs["name"])
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=ScaleSerializer, responses=ModelSerializer)
    @action(detail=True, methods=["post"])
    def scale(self, request, name=None):
        serializer = ScaleSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        try:
            if "replicas" in data:
                catalog.model_scale(name=name, replicas=data["replicas"], actor=actor(request))
            else:
                catalog.model_scale_bounds(name=name, min=data.get("min"), max=data.get("max"), actor=actor(request))
        except catalog.CatalogInvalid as exc:
            return _catalog_error(exc)
        return Response(ModelSerializer(self.get_queryset().get(name=name)).data)


    def _rollout(self, name):
        model, latest = rollout.rollout_latest(name=name)
        counts = rollout.replicas_by_revision(model)
        return Response(RolloutStatusSerializer({
            "model": model.name, "revision": model.revision, "wanted": model.replicas, **counts,
            "max_surge": model.max_surge, "max_unavailable": model.max_unavailable,
            "max_failures": settings.LLMGW_ROLLOUT_MAX_FAILURES, "rollout": latest,
        }).data)

    @extend_schema(responses=RolloutStatusSerializer)
    @action(detail=True, methods=["get"], url_path="rollout")
    def rollout_status(self, request, name=None):
        """The model's revision, its ready replicas on it, and its latest rollout: progress, what it waits for."""
        return self._rollout(name)

    @extend_schema(request=None, responses=RolloutStatusSerializer)
    @action(detail=True, methods=["post"], url_path="rollout/pause")
    def rollout_pause(self, request, name=None):
        """Hold the running rollout: no new replacement starts (those under way finish). 409 if none runs."""
        rollout.rollout_pause(name=name, actor=actor(request))
        return self._rollout(name)

    @extend_schema(request=None, responses=RolloutStatusSerializer)
    @action(detail=True, methods=["post"], url_path="rollout/resume")
    def rollout_resume(self, request, name=None):
        """Carry on a paused rollout, or try a failed one again. 409 if there is none."""
        rollout.rollout_resume(name=name, actor=actor(request))
        return self._rollout(name)

    @extend_schema(request=None, responses=RolloutStatusSerializer)
    @action(detail=True, methods=["post"], url_path="rollout/undo")
    def rollout_undo(self, request, name=None):
        """Back to the previous revision (a new revision number), rolled out like any change. 409 if there is none."""
        rollout.rollout_undo(name=name, actor=actor(request))
        return self._rollout(name)


class CatalogApplyView(APIView):
    required_permissions = {"post": ("replicas.add_catalogentry", "replicas.change_catalogentry")}

    @extend_schema(request=CatalogApplySerializer, responses={200: dict})
    def post(self, request):
        serializer = CatalogApplySerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        if serializer.validated_data["prune"] and not request.user.has_perm("replicas.delete_catalogentry"):
            raise PermissionDenied("pruning needs the permission replicas.delete_catalogentry")
        try:
            result = catalog.catalog_apply(entries=serializer.validated_data["models"],
                                           prune=serializer.validated_data["prune"], actor=actor(request),
                                           admin=request.user.has_perm("replicas.trust_engine_code"))
        except catalog.CatalogInvalid as exc:
            return _catalog_error(exc)
        return Response(result)


class ReplicaViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = ReplicaSerializer
    permission_model = "replicas.replica"

    def get_queryset(self):
        params = self.request.query_params
        return selectors.replica_list(model=params.get("model"), include_stopped=params.get("all") == "1")


class DrainViewSet(mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    serializer_class = DrainSerializer
    permission_model = "replicas.drain"
    # Draining, and calling a drain off, is operating the node.
    required_permissions = {"create": ("nodes.change_node",), "cancel": ("nodes.change_node",)}
    # Ids only, and ones the database can hold: anything else is a 404, not a 500.
    lookup_value_regex = "[0-9]{1,18}"

    def get_queryset(self):
        return selectors.drain_list(node=self.request.query_params.get("node"))

    @extend_schema(request=DrainCreateSerializer, responses=DrainSerializer)
    def create(self, request, *args, **kwargs):
        serializer = DrainCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        started = drain.drain_start(node_name=serializer.validated_data["node"], actor=actor(request))
        return Response(DrainSerializer(started).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=DrainSerializer)
    @action(detail=True, methods=["post"])
    @no_body
    def cancel(self, request, pk=None):
        """End a running or blocked drain: its replicas stop moving and keep
        running where they are; the node stays cordoned. 409 if it has ended."""
        return Response(DrainSerializer(drain.drain_cancel(drain_id=int(pk), actor=actor(request))).data)
