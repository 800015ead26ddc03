from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import viewsets

from ..choices import CertificateKind
from ..selectors import cert_list
from .serializers import CertificateSerializer


@extend_schema_view(
    list=extend_schema(
        parameters=[OpenApiParameter("kind", str, enum=CertificateKind.values, description="only this kind")]
    )
)
class CertificateViewSet(viewsets.ReadOnlyModelViewSet):
    """Read-only: certificates are issued and revoked with 'llmgw ctl cert' on
    the host that holds the authority's key."""

    serializer_class = CertificateSerializer
    permission_model = "pki.certificate"
    lookup_field = "serial"

    def get_queryset(self):
        return cert_list(kind=self.request.query_params.get("kind"))
