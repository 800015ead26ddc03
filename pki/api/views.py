from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from accounts.actors import actor

from ..choices import CertificateKind
from ..selectors import cert_list
from ..services import PkiError, cert_revoke
from .serializers import CertificateSerializer, RevokeSerializer


@extend_schema_view(
    list=extend_schema(
        parameters=[OpenApiParameter("kind", str, enum=CertificateKind.values, description="only this kind")]
    )
)
class CertificateViewSet(viewsets.ReadOnlyModelViewSet):
    """Certificates, and their revocation (as 'llmgw ctl cert revoke' and the
    node page do). Issuing stays with 'llmgw ctl cert' on the host that holds
    the authority's key."""

    serializer_class = CertificateSerializer
    permission_model = "pki.certificate"
    required_permissions = {"revoke": ("pki.change_certificate",)}
    lookup_field = "serial"

    def get_queryset(self):
        return cert_list(kind=self.request.query_params.get("kind"))

    @extend_schema(request=RevokeSerializer, responses=CertificateSerializer(many=True))
    @action(detail=False, methods=["post"])
    def revoke(self, request):
        """Revoke a node's live certificates, or one by serial: the agent API
        refuses them from then on; an Event names who revoked what."""
        serializer = RevokeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            rows = cert_revoke(actor=actor(request), **serializer.validated_data)
        except PkiError as exc:
            raise ValidationError({"target": [str(exc)]}) from None
        return Response(CertificateSerializer(rows, many=True).data)
