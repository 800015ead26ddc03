import uuid

from django.conf import settings
from django.db import models

from .choices import ACTIVE, JobKind, JobStatus, StepStatus


def _marker() -> str:
    return uuid.uuid4().hex


class Hypervisor(models.Model):
    """A Proxmox VE host (or cluster) llmgw may create VMs on, with an API token."""

    name = models.CharField(max_length=63, unique=True)
    url = models.CharField(max_length=255, help_text="https://pve.example:8006")
    token_id = models.CharField(max_length=128, help_text="user@realm!tokenname")
    # Fernet-encrypted with the key file under the PKI directory; never shown.
    token_secret_encrypted = models.TextField()
    ca_pem = models.TextField(blank=True, help_text="the CA that signed the API's certificate (PEM)")
    node = models.CharField(max_length=64, blank=True, help_text="Proxmox node; empty: the cluster's only node")
    storage = models.CharField(max_length=64, default="local-lvm")
    image = models.CharField(max_length=255, help_text="cloud image volume, e.g. local:import/noble.qcow2")
    bridge = models.CharField(max_length=64, default="vmbr0")
    pool = models.CharField(max_length=64, blank=True)
    ciuser = models.CharField(max_length=32, default="ubuntu")
    nameserver = models.CharField(max_length=255, blank=True)
    ssh_keys = models.TextField(blank=True, help_text="operators' SSH public keys put into every VM, one a line")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Job(models.Model):
    """A long operation run by the worker, step by step: a person can watch it
    and a restarted worker resumes it."""

    kind = models.CharField(max_length=16, choices=JobKind.choices)
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED)
    status_changed_at = models.DateTimeField()
    status_reason = models.TextField(blank=True)
    # The node id: VM name, hostname and (later) certificate CN.
    node_name = models.CharField(max_length=63)
    hypervisor = models.ForeignKey(Hypervisor, on_delete=models.PROTECT, null=True, blank=True, related_name="jobs")
    params = models.JSONField(default=dict)
    # Written into what the job creates (the VM's description), so that a
    # later attempt can tell its own VM from someone else's.
    marker = models.CharField(max_length=32, default=_marker, editable=False)
    # The SSH host key the new machine presented, pinned for onboarding.
    ssh_host_key = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Held by the worker running a step; a worker killed mid-step lets it expire.
    lease_owner = models.CharField(max_length=64, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    # When the job's next advance is due (a wait re-schedules the task).
    next_run_at = models.DateTimeField(null=True, blank=True)
    # Bumped by every enqueue; a task message carrying an older value is
    # stale (its chain was replaced) and does nothing.
    wake = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-created_at", "-id"]
        permissions = [("run_provisioning", "Can provision machines: start, retry and cancel jobs; manage hypervisors")]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(status__in=JobStatus.values), name="%(app_label)s_%(class)s_status_valid"
            ),
            # One job at a time may work on a node.
            models.UniqueConstraint(
                fields=["node_name"],
                condition=models.Q(status__in=sorted(ACTIVE)),
                name="%(app_label)s_%(class)s_one_active_per_node",
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} {self.kind} {self.node_name}"


class Step(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="steps")
    index = models.PositiveSmallIntegerField()
    name = models.CharField(max_length=32)
    title = models.CharField(max_length=128)
    status = models.CharField(max_length=16, choices=StepStatus.choices, default=StepStatus.PENDING)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # [{"at": iso time, "line": text}]: what the step did, in words.
    log = models.JSONField(default=list, blank=True)
    # The step's own memory between runs (a task UPID, a deadline).
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["job", "index"]
        constraints = [
            models.UniqueConstraint(fields=["job", "index"], name="%(app_label)s_%(class)s_unique_index"),
            models.CheckConstraint(
                condition=models.Q(status__in=StepStatus.values), name="%(app_label)s_%(class)s_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} step {self.index} {self.name}"
