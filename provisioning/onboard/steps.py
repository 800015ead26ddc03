"""The onboarding job (a machine reached over SSH becomes a heartbeating
node): its kind and its steps, in order. install.py reaches, checks and
installs; enroll.py gives the node its certificate, configuration and unit,
and waits for its first heartbeat. The request and the job's creation:
request.py."""

from __future__ import annotations

from ..choices import JobKind
from ..stepkit import StepSpec
from .enroll import certificate, configure, first_heartbeat, start
from .install import agent_install, connect, preflight

KIND = JobKind.ONBOARD


ONBOARD_STEPS = [
    StepSpec("connect", "Connect over SSH (pinned host key)", connect),
    StepSpec("preflight", "Preflight checks", preflight),
    StepSpec("agent", "Install the agent from the uploaded wheels", agent_install),
    StepSpec("certificate", "Key on the node, certificate signed, root trusted", certificate),
    StepSpec("configure", "Write agent.yaml and check it", configure),
    StepSpec("start", "Install the unit; systemctl enable --now", start),
    StepSpec("heartbeat", "Wait for the first heartbeat", first_heartbeat),
]
