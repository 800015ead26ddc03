from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import viewsets

from .. import selectors
from .serializers import EventSerializer


@extend_schema(
    parameters=[
        OpenApiParameter("node", str, description="only events about this node"),
        OpenApiParameter("kind", str, description="only events of this kind"),
        OpenApiParameter("limit", int, description="at most this many, newest first (default 200)"),
    ]
)
class EventViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = EventSerializer
    permission_model = "core.event"

    def get_queryset(self):
        params = self.request.query_params
        events = selectors.event_list(node=params.get("node"), kind=params.get("kind"))
        if self.action == "list":
            try:
                limit = max(1, min(int(params.get("limit", 200)), 5000))
            except ValueError:
                limit = 200
            return events[:limit]
        return events
