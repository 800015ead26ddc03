from rest_framework import viewsets

from ..selectors import cert_list
from .serializers import CertificateSerializer


class CertificateViewSet(viewsets.ReadOnlyModelViewSet):
    """Read-only: certificates are issued and revoked with 'llmgw ctl cert' on
    the host that holds the authority's key."""

    serializer_class = CertificateSerializer
    lookup_field = "serial"

    def get_queryset(self):
        return cert_list(kind=self.request.query_params.get("kind"))
