from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from accounts.actors import actor
from core.strict import no_body

from .. import selectors, services, sshkeys
from ..onboard import request as onboard_request
from ..choices import JobStatus
from ..validation import RequestInvalid
from .serializers import (CheckSerializer, HypervisorSerializer, JobSerializer, OnboardSerializer,
                          ProvisionSerializer, SshKeySerializer)


def _service(fn, **kwargs):
    try:
        return fn(**kwargs)
    except RequestInvalid as exc:
        raise ValidationError({field: [message] for field, message in exc.errors.items()}) from None


class HypervisorViewSet(viewsets.ModelViewSet):
    """Proxmox hosts llmgw may create VMs on. The token secret is write-only."""

    serializer_class = HypervisorSerializer
    permission_model = "provisioning.hypervisor"
    # Checking reaches the hypervisor with its token: as provisioning does.
    required_permissions = {"check": ("provisioning.run_provisioning",)}
    lookup_field = "name"
    lookup_value_regex = "[^/]+"

    def get_queryset(self):
        return selectors.hypervisor_list()

    def perform_create(self, serializer):
        serializer.instance = _service(services.hypervisor_create, actor=actor(self.request),
                                       **serializer.validated_data)

    def perform_update(self, serializer):
        data = dict(serializer.validated_data)
        data.pop("name", None)
        serializer.instance = _service(services.hypervisor_update, name=self.kwargs["name"],
                                       actor=actor(self.request), **data)

    @extend_schema(responses={200: None})
    def destroy(self, request, name=None):
        # An answer with a body: 'llmgw ctl' reads JSON.
        services.hypervisor_delete(name=name, actor=actor(request))
        return Response({"name": name, "removed": True})

    @extend_schema(request=None, responses=CheckSerializer,
                   parameters=[OpenApiParameter("vmid", int, description="check the VM paths of this VMID")])
    @action(detail=True, methods=["post"])
    @no_body
    def check(self, request, name=None):
        vmid = request.query_params.get("vmid")
        if vmid is not None and not vmid.isdigit():
            raise ValidationError({"vmid": "an integer"})
        return Response(services.hypervisor_check(name=name, vmid=int(vmid) if vmid else None))

    @extend_schema(request=None, responses=SshKeySerializer)
    @action(detail=False, methods=["get"], url_path="ssh-key")
    def ssh_key(self, request):
        public = sshkeys.control_plane_public_key()
        return Response({"public_key": public, "fingerprint": sshkeys.fingerprint(public)})


@extend_schema_view(
    list=extend_schema(parameters=[
        OpenApiParameter("status", str, enum=JobStatus.values, description="only jobs in this status"),
        OpenApiParameter("node", str, description="only jobs for this node"),
    ])
)
class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Provisioning jobs and their steps."""

    serializer_class = JobSerializer
    permission_model = "provisioning.job"
    required_permissions = {action: ("provisioning.run_provisioning",) for action in ("provision", "onboard", "retry", "cancel")}
    lookup_value_regex = r"\d+"

    def get_queryset(self):
        params = self.request.query_params
        return selectors.job_list(status=params.get("status"), node=params.get("node"))

    @extend_schema(request=ProvisionSerializer, responses={201: JobSerializer})
    @action(detail=False, methods=["post"])
    def provision(self, request):
        serializer = ProvisionSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        job = _service(services.job_provision_create, request=serializer.validated_data, user=request.user)
        return Response(JobSerializer(selectors.job_get(job_id=job.pk)).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=OnboardSerializer, responses={201: JobSerializer})
    @action(detail=False, methods=["post"])
    def onboard(self, request):
        """Onboard a machine over SSH (needs provisioning.run_provisioning)."""
        serializer = OnboardSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        job = _service(onboard_request.job_onboard_create, request=serializer.validated_data, user=request.user)
        return Response(JobSerializer(selectors.job_get(job_id=job.pk)).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=JobSerializer)
    @action(detail=True, methods=["post"])
    @no_body
    def retry(self, request, pk=None):
        services.job_retry(job_id=int(pk), actor=actor(request))
        return Response(JobSerializer(selectors.job_get(job_id=int(pk))).data)

    @extend_schema(request=None, responses=JobSerializer)
    @action(detail=True, methods=["post"])
    @no_body
    def cancel(self, request, pk=None):
        services.job_cancel(job_id=int(pk), actor=actor(request))
        return Response(JobSerializer(selectors.job_get(job_id=int(pk))).data)
