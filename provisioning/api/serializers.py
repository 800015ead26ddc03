from rest_framework import serializers

from core.strict import StrictInput

from .. import sshkeys
from ..models import Hypervisor, Job, Step
from ..onboard.request import onboard_request_check
from ..validation import RequestInvalid, hypervisor_fields_check, provision_request_check


def _check(fn, data):
    try:
        return fn(data)
    except RequestInvalid as exc:
        raise serializers.ValidationError(exc.errors) from None


class HypervisorSerializer(StrictInput, serializers.ModelSerializer):
    token_secret = serializers.CharField(write_only=True, required=False, allow_blank=True, style={"input_type": "password"},
                                         help_text="the API token's secret; stored encrypted, never shown")
    ca_pem = serializers.CharField(write_only=True, required=False, allow_blank=True,
                                   help_text="PEM of the CA that signed the API's certificate")
    has_ca = serializers.SerializerMethodField()

    class Meta:
        model = Hypervisor
        fields = ["name", "url", "token_id", "token_secret", "ca_pem", "has_ca", "node", "storage", "image",
                  "bridge", "pool", "ciuser", "nameserver", "ssh_keys", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]
        # The services check names and uniqueness with the other fields.
        extra_kwargs = {"name": {"validators": []}}

    def get_has_ca(self, row) -> bool:
        return bool(row.ca_pem)

    def validate(self, attrs):
        _check(hypervisor_fields_check, attrs)
        if self.instance is None and not attrs.get("token_secret", "").strip():
            raise serializers.ValidationError({"token_secret": "the API token's secret is required"})
        return attrs


class CheckSerializer(serializers.Serializer):
    name = serializers.CharField()
    reachable = serializers.BooleanField()
    error = serializers.CharField()
    version = serializers.CharField()
    missing = serializers.ListField(child=serializers.DictField(child=serializers.CharField()))


class SshKeySerializer(serializers.Serializer):
    public_key = serializers.CharField()
    fingerprint = serializers.CharField()


class OnboardSerializer(StrictInput, serializers.Serializer):
    node = serializers.CharField(help_text="the node id: hostname and certificate CN")
    addr = serializers.CharField(help_text="where to reach it over SSH (IP or host name)")
    ssh_user = serializers.CharField(required=False, default="root")
    ssh_port = serializers.IntegerField(required=False, default=22)
    fabrics = serializers.ListField(child=serializers.CharField(), required=False, default=list,
                                    help_text="NAME:HCA,HCA or NAME (= mlx5_0,mlx5_1); none: an island")
    mgmt_interface = serializers.CharField(required=False, default="eth0")
    mgmt_addr = serializers.CharField(required=False, allow_blank=True, default="", help_text="default: addr")
    nvidia_smi = serializers.CharField(required=False, allow_blank=True, default="")
    ib_root = serializers.CharField(required=False, default="/sys/class/infiniband")
    skip_gpus = serializers.BooleanField(required=False, default=False)
    host_key_fingerprint = serializers.CharField(
        required=False, allow_blank=True, default="",
        help_text="SHA256:... for a machine llmgw did not create (else the key pinned when it was made)")
    reinstall = serializers.BooleanField(required=False, default=False,
                                         help_text="onboard a node that already heartbeats")
    agent_server = serializers.CharField(required=False, allow_blank=True, default="",
                                         help_text="the agent API as the node reaches it (default LLMGW_AGENT_SERVER)")
    root = serializers.CharField(required=False, default="/")
    etc_dir = serializers.CharField(required=False, allow_blank=True, default="")
    unit_dir = serializers.CharField(required=False, allow_blank=True, default="")

    def validate(self, attrs):
        _check(onboard_request_check, attrs)
        return attrs


class OnboardOptionsSerializer(OnboardSerializer):
    """``provision``'s ``onboard``: the fields of /jobs/onboard/ other than
    node and addr (the VM's), checked with them by the service."""

    node = None
    addr = None

    def to_internal_value(self, data):
        # Only what was given: a default here (ssh_user root) would hide the
        # service's own (after provisioning, the VM's cloud-init user).
        value = super().to_internal_value(data)
        return {key: value[key] for key in value if key in data}

    def validate(self, attrs):
        return attrs


class ProvisionSerializer(StrictInput, serializers.Serializer):
    node = serializers.CharField(help_text="the node id: VM name, hostname and certificate CN")
    hypervisor = serializers.CharField(required=False, allow_blank=True,
                                       help_text="default: the only hypervisor")
    vmid = serializers.IntegerField()
    ip = serializers.CharField(help_text="address with prefix, e.g. 10.0.0.144/24")
    gateway = serializers.CharField()
    cores = serializers.IntegerField(default=16)
    memory = serializers.IntegerField(default=65536, help_text="MiB")
    disk = serializers.CharField(default="200G")
    nameserver = serializers.CharField(required=False, allow_blank=True, default="")
    onboard = OnboardOptionsSerializer(required=False, allow_null=True, default=None,
                                       help_text="onboard the VM once it is made: the fields of /jobs/onboard/ "
                                                 "other than node and addr")

    def validate(self, attrs):
        return _check(provision_request_check, attrs) and attrs


class StepSerializer(serializers.ModelSerializer):
    class Meta:
        model = Step
        fields = ["index", "name", "title", "status", "started_at", "finished_at", "log"]


class JobSerializer(serializers.ModelSerializer):
    hypervisor = serializers.SlugRelatedField(slug_field="name", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    steps = StepSerializer(many=True, read_only=True)
    ssh_host_key_fingerprint = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = ["id", "kind", "node_name", "hypervisor", "status", "status_reason", "status_changed_at", "params",
                  "ssh_host_key", "ssh_host_key_fingerprint", "created_by", "created_at", "finished_at", "steps"]

    def get_ssh_host_key_fingerprint(self, job) -> str:
        return sshkeys.fingerprint(job.ssh_host_key)
