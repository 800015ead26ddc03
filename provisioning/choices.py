from django.db import models


class JobKind(models.TextChoices):
    PROVISION = "provision"
    ONBOARD = "onboard"


class JobStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# Allowed transitions, as data. Every status change goes through
# provisioning.services.job_transition, which checks this table.
JOB_TRANSITIONS: dict[str, set[str]] = {
    JobStatus.QUEUED: {JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED},
    JobStatus.RUNNING: {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED},
    # A retry queues the job again; the steps already done are kept.
    JobStatus.FAILED: {JobStatus.QUEUED},
    JobStatus.CANCELLED: {JobStatus.QUEUED},
    JobStatus.SUCCEEDED: set(),
}

ACTIVE = frozenset({JobStatus.QUEUED, JobStatus.RUNNING})
TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


class StepStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    # Found already done in the world (an earlier attempt did it).
    SKIPPED = "skipped"
    FAILED = "failed"


# Every step status change goes through provisioning.services.step_transition.
STEP_TRANSITIONS: dict[str, set[str]] = {
    StepStatus.PENDING: {StepStatus.RUNNING},
    # Back to pending: the job was cancelled while the step ran.
    StepStatus.RUNNING: {StepStatus.DONE, StepStatus.SKIPPED, StepStatus.FAILED, StepStatus.PENDING},
    # A retry runs the failed step again.
    StepStatus.FAILED: {StepStatus.PENDING},
    StepStatus.DONE: set(),
    StepStatus.SKIPPED: set(),
}

STEP_FINISHED = frozenset({StepStatus.DONE, StepStatus.SKIPPED})

# The Proxmox privileges a provisioning job needs, and where (see
# provisioning.proxmox.needed_privileges for the paths).
VM_PRIVILEGES = (
    "VM.Allocate",
    "VM.Audit",
    "VM.PowerMgmt",
    "VM.Config.CDROM",
    "VM.Config.CPU",
    "VM.Config.Cloudinit",
    "VM.Config.Disk",
    "VM.Config.HWType",
    "VM.Config.Memory",
    "VM.Config.Network",
    "VM.Config.Options",
)


class ProvisioningEventKind(models.TextChoices):
    """The kinds of Event provisioning records (registered with core in ProvisioningConfig.ready)."""

    PROVISIONING = "provisioning"
