"""The onboarding job, first half: the machine reached over SSH, checked, and
the agent installed on it (enroll.py: the second half; steps.py: the list).

Every step connects afresh to the pinned host key, looks first and skips what
is already done, so a job killed anywhere resumes. The node makes its own key;
only its certificate request comes back here, and only the certificate and the
authority's root go out. The order (agent before key) lets the agent's own
``llmgw-agent csr`` make the key.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from django.conf import settings

from .. import agentwheel, nodessh, selectors, services, sshkeys
from ..exceptions import StepFailed
from ..stepkit import Done, Skipped, StepContext, Wait
from .request import hcas_in_two_fabrics

UNIT = "llmgw-agent"
UNIT_TEMPLATE = agentwheel.UNIT_FILE
MIN_PYTHON = (3, 11)
q = shlex.quote


@dataclass(frozen=True)
class NodePaths:
    root: PurePosixPath
    etc: PurePosixPath
    unit_dir: PurePosixPath
    node: str

    @property
    def agent_dir(self): return self.root / "opt/llmgw-agent"
    @property
    def venv(self): return self.agent_dir / "venv"
    @property
    def agent(self): return self.venv / "bin/llmgw-agent"
    @property
    def work_dir(self): return self.root / "var/lib/llmgw-agent"
    @property
    def config(self): return self.etc / "agent.yaml"
    @property
    def key(self): return self.etc / f"{self.node}-key.pem"
    @property
    def cert(self): return self.etc / f"{self.node}.pem"
    @property
    def ca(self): return self.etc / "ca.pem"
    @property
    def unit(self): return self.unit_dir / f"{UNIT}.service"


def paths(job) -> NodePaths:
    p = job.params
    return NodePaths(PurePosixPath(p["root"]), PurePosixPath(p["etc_dir"]), PurePosixPath(p["unit_dir"]),
                     job.node_name)


def _pin(job) -> nodessh.Pin:
    if job.ssh_host_key:
        return nodessh.Pin(key_line=job.ssh_host_key)
    if job.params.get("host_key_fingerprint"):
        return nodessh.Pin(fingerprint=job.params["host_key_fingerprint"])
    recorded = selectors.node_host_key(node_name=job.node_name)
    if recorded:
        return nodessh.Pin(key_line=recorded)
    raise StepFailed(
        f"no host key is pinned for {job.node_name}: llmgw did not create this machine. Read its fingerprint on "
        "its console (ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub), and give it as --host-key-fingerprint "
        "SHA256:...")


def _ssh(ctx: StepContext, body):
    p = ctx.job.params
    try:
        result = nodessh.over_ssh(host=p["addr"], port=p["ssh_port"], user=p["ssh_user"], pin=_pin(ctx.job),
                                  body=body)
    except nodessh.HostKeyMismatch as exc:
        raise StepFailed(f"{exc}; nothing was done on it. If the machine was reinstalled, confirm its new key's "
                         "fingerprint and pass --host-key-fingerprint SHA256:...") from None
    except nodessh.NodeUnreachable as exc:
        left = ctx.deadline("unreachable_until", settings.LLMGW_PROVISION_UNREACHABLE_DEADLINE)
        if left <= 0:
            raise StepFailed(str(exc)) from None
        ctx.log(f"{exc}; trying again")
        return Wait(min(ctx.backoff("unreachable_poll", start=1.0, ceiling=15.0), max(left, 0.1)))
    ctx.data.pop("unreachable_until", None)
    return result


def _must(result: nodessh.Result, what: str) -> str:
    if not result.ok:
        raise StepFailed(f"{what} failed (exit {result.rc}): {result.text()}")
    return result.out


def connect(ctx: StepContext):
    async def body(s: nodessh.Session):
        return s.host_key, s.root
    got = _ssh(ctx, body)
    if isinstance(got, Wait):
        return got
    host_key, root = got
    services.job_host_key_pin(job_id=ctx.job.pk, host_key=host_key)
    p = ctx.job.params
    how = "as root" if root else "with sudo -n"
    return Done(f"connected to {p['ssh_user']}@{p['addr']}:{p['ssh_port']} ({how}); its host key "
                f"{sshkeys.fingerprint(host_key)} is the pinned one")


def _preflight_script(job) -> str:
    p = job.params
    nvsmi = q(p["nvidia_smi"] or "nvidia-smi")
    lines = [
        'echo "systemctl=$(command -v systemctl || true)"',
        'echo "uid=$(id -u)"',
        'if [ "$(id -u)" = 0 ]; then echo sudo=root; elif out=$(sudo -n true 2>&1); then echo sudo=ok; '
        'else echo "sudo=$(printf %s "$out" | head -n1)"; fi',
        "echo \"python=$(python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])' 2>&1 | head -n1)\"",
        "echo \"venv=$(python3 -c 'import venv; print(\"ok\")' 2>&1 | tail -n1)\"",
        'echo "clock=$(date +%s)"',
    ]
    if not p["skip_gpus"]:
        lines.append(
            f"if ! command -v {nvsmi} >/dev/null 2>&1; then echo nvidia=missing; "
            f"elif out=$({nvsmi} --query-gpu=index,uuid,name,memory.total,pci.bus_id --format=csv,noheader,nounits "
            '2>&1); then echo "gpus=$(printf "%s\\n" "$out" | grep -c .)"; '
            'else echo "nvidia=$(printf %s "$out" | head -n1)"; fi')
    for fabric in p["fabrics"]:
        for hca in fabric["hcas"]:
            path = q(f"{p['ib_root']}/{hca}")
            lines.append(f'if [ -d {path} ]; then echo "hca.{hca}=ok"; else echo "hca.{hca}=missing"; fi')
    return "\n".join(lines)


def preflight(ctx: StepContext):
    p = ctx.job.params
    problems = hcas_in_two_fabrics(p["fabrics"])
    if problems:
        raise StepFailed("; ".join(problems) + ". Nothing was installed; fix --fabric")

    async def body(s: nodessh.Session):
        return await s.run(_preflight_script(ctx.job), privileged=False)
    got = _ssh(ctx, body)
    if isinstance(got, Wait):
        return got
    now = time.time()
    facts = dict(line.split("=", 1) for line in _must(got, "the preflight").splitlines() if "=" in line)
    problems = []
    if not facts.get("systemctl"):
        problems.append("systemd: no systemctl on the PATH (the agent runs as a systemd unit)")
    if facts.get("sudo") not in ("root", "ok"):
        problems.append(f"sudo -n does not work for {p['ssh_user']} ({facts.get('sudo') or 'no answer'}): "
                        "give that user passwordless sudo, or log in as root")
    version = facts.get("python", "")
    try:
        if tuple(int(x) for x in version.split(".")) < MIN_PYTHON:
            problems.append(f"python3 is {version}; the agent needs 3.11 or newer")
    except ValueError:
        problems.append(f"python3 does not run ({version or 'not found'}); the agent needs Python 3.11 or newer")
    if facts.get("venv") != "ok":
        problems.append(f"python3 cannot make a virtual environment ({facts.get('venv')}): install python3-venv")
    if not p["skip_gpus"]:
        if facts.get("nvidia") == "missing":
            problems.append(f"nvidia-smi: {p['nvidia_smi'] or 'nvidia-smi'} is not there (install the NVIDIA "
                            "driver, give --nvidia-smi PATH, or --skip-gpus for a node without GPUs)")
        elif "nvidia" in facts:
            problems.append(f"nvidia-smi fails: {facts['nvidia']}")
    for fabric in p["fabrics"]:
        for hca in fabric["hcas"]:
            if facts.get(f"hca.{hca}") != "ok":
                problems.append(f"HCA {hca} (fabric {fabric['name']}) is not under {p['ib_root']}")
    try:
        skew = abs(int(facts.get("clock", "0")) - now)
    except ValueError:
        skew = float("inf")
    if skew > settings.LLMGW_ONBOARD_CLOCK_SKEW:
        problems.append(f"the node's clock is {skew:.0f}s away from the control plane's (more than "
                        f"{settings.LLMGW_ONBOARD_CLOCK_SKEW:.0f}s; certificates depend on it): set up NTP")
    if problems:
        raise StepFailed("preflight: " + "; ".join(problems))
    gpus = "GPUs skipped" if p["skip_gpus"] else f"{facts.get('gpus', '0')} GPU(s)"
    return Done(f"preflight passed: systemd, {'root' if facts.get('sudo') == 'root' else 'sudo -n'}, "
                f"python {version}, {gpus}, clock within {skew:.0f}s")


def _install_script(*, agent_dir: str, digest: str, pip_wheel: str, wheels: list[str]) -> str:
    """Each build gets its own venv (``<agent_dir>/<digest>``) and ``venv`` is a
    link switched to it at the end: a running agent keeps its files until the
    unit restarts it, an interrupted install is redone from scratch, and the
    build before stays (the one running) while older ones are removed. The
    venv has no pip: pip runs from its uploaded wheel."""
    pip = (f"PIP_CONFIG_FILE=/dev/null PIP_ROOT_USER_ACTION=ignore {q(digest)}/bin/python {q(pip_wheel)}/pip "
           "install --quiet --disable-pip-version-check --no-index --no-deps --no-compile "
           + " ".join(q(w) for w in wheels))
    return "\n".join([
        f"mkdir -p {q(agent_dir)} && cd {q(agent_dir)}",
        'old=$(readlink venv || true)',
        f"rm -rf {q(digest)} venv.new",
        f"python3 -m venv --without-pip {q(digest)}",
        pip,
        f"ln -s {q(digest)} venv.new",
        "[ -L venv ] || rm -rf venv",
        "mv -T venv.new venv",
        'for d in */; do d=${d%/}; case "$d" in venv|"$old"|' + q(digest) + ') ;; *) rm -rf "$d";; esac; done',
    ])


_STAGING = re.compile(r"/tmp/llmgw-agent-[A-Za-z0-9]{10}")


def agent_install(ctx: StepContext):
    paths_ = paths(ctx.job)
    wheels = agentwheel.wheels_ensure(Path(settings.DATA_DIR) / "agent-wheels")
    digest = wheels.name

    async def body(s: nodessh.Session):
        # One command: installed already, or a fresh staging directory of the
        # SSH user's (sftp writes into it), named by mktemp: a name known in
        # advance could be made first by another user of the node's /tmp, or
        # be another job's (two control planes' tests on one machine did).
        have = await s.run(f'if [ "$(readlink {q(str(paths_.venv))})" = {q(digest)} ] && '
                           f'{q(str(paths_.agent))} version >/dev/null 2>&1; then echo installed; '
                           f'else mktemp -d /tmp/llmgw-agent-XXXXXXXXXX; fi', privileged=False)
        _must(have, "making the staging directory")
        staging = have.out.strip()
        if staging == "installed":
            return None
        if not _STAGING.fullmatch(staging):
            raise StepFailed(f"mktemp on the node answered {staging[:200]!r}, not a staging directory")
        async with s.conn.start_sftp_client() as sftp:
            await sftp.put([str(w) for w in sorted(wheels.glob("*.whl"))], staging)
        script = _install_script(
            agent_dir=str(paths_.agent_dir), digest=digest,
            pip_wheel=f"{staging}/{agentwheel.pip_wheel(wheels).name}",
            wheels=[f"{staging}/{w.name}" for w in agentwheel.install_wheels(wheels)])
        return await s.run(f"sh -ec {q(script)}; rc=$?; rm -rf {q(staging)}; exit $rc")
    got = _ssh(ctx, body)
    if isinstance(got, Wait):
        return got
    if got is None:
        return Skipped(f"the agent {digest} is already installed in {paths_.venv}")
    _must(got, "installing the agent")
    return Done(f"the agent ({digest}, {len(agentwheel.install_wheels(wheels))} wheels) installed in "
                f"{paths_.agent_dir / digest}, linked as {paths_.venv}")
