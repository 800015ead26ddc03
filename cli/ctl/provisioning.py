"""``llmgw ctl hypervisors|provision|jobs|ssh-key``: provisioning, over the REST API.

An area of ``llmgw ctl`` (see ``cli/ctl/__init__.py``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .common import CtlError, api_call, output_flag, print_json, print_table

HYPERVISOR_OPTIONS = ("node", "storage", "image", "bridge", "pool", "ciuser", "nameserver")


def register(ctl_sub) -> None:
    hyp = ctl_sub.add_parser("hypervisors", help="Proxmox hosts llmgw may create VMs on")
    output_flag(hyp)
    hyp.set_defaults(func=_hypervisors_list)
    hyp_sub = hyp.add_subparsers(dest="hypervisors_command")
    add = hyp_sub.add_parser("add", help="add a hypervisor with an API token (its secret is never shown again)")
    add.add_argument("name")
    add.add_argument("--url", required=True, help="https://pve.example:8006")
    add.add_argument("--token-id", required=True, help="user@realm!tokenname")
    add.add_argument("--token-secret-file", required=True, help="file holding the token's secret ('-': stdin)")
    _hypervisor_options(add)
    add.set_defaults(func=_hypervisors_add)
    update = hyp_sub.add_parser("update", help="change a hypervisor's settings or token secret")
    update.add_argument("name")
    update.add_argument("--url")
    update.add_argument("--token-id")
    update.add_argument("--token-secret-file")
    _hypervisor_options(update)
    update.set_defaults(func=_hypervisors_update)
    remove = hyp_sub.add_parser("remove", help="forget a hypervisor (its VMs stay)")
    remove.add_argument("name")
    remove.set_defaults(func=_hypervisors_remove)
    check = hyp_sub.add_parser("check", help="log in and name each privilege the token lacks")
    check.add_argument("name")
    check.add_argument("--vmid", type=int, help="check the paths of this VMID")
    check.set_defaults(func=_hypervisors_check)

    prov = ctl_sub.add_parser("provision", help="create a node's VM on a hypervisor (a job)")
    prov.add_argument("node", nargs="?", help="the node id: VM name, hostname and certificate CN")
    prov.add_argument("--name", dest="name_flag", metavar="NODE", help="the node id (the seeds' spelling)")
    prov.add_argument("--vmid", type=int, required=True)
    prov.add_argument("--ip", required=True, help="address with prefix, e.g. 10.0.0.144/24")
    prov.add_argument("--gateway", required=True)
    prov.add_argument("--hypervisor", default="", help="default: the only hypervisor")
    prov.add_argument("--cores", type=int, default=16)
    prov.add_argument("--memory", type=int, default=65536, help="MiB (default 65536)")
    prov.add_argument("--disk", default="200G")
    prov.add_argument("--nameserver", default="", help="default: the hypervisor's")
    prov.add_argument("--onboard", action="store_true", help="then onboard the new VM (a second job)")
    onboard_flags(prov)
    _wait_flags(prov)
    prov.set_defaults(func=_provision)

    jobs = ctl_sub.add_parser("jobs", help="provisioning jobs: list, show, retry, cancel")
    jobs.add_argument("--status")
    jobs.add_argument("--node")
    output_flag(jobs)
    jobs.set_defaults(func=_jobs_list)
    jobs_sub = jobs.add_subparsers(dest="jobs_command")
    show = jobs_sub.add_parser("show", help="a job's steps, times and log")
    show.add_argument("id", type=int)
    output_flag(show)
    show.set_defaults(func=_jobs_show)
    retry = jobs_sub.add_parser("retry", help="run a failed or cancelled job again from its failed step")
    retry.add_argument("id", type=int)
    _wait_flags(retry)
    retry.set_defaults(func=_jobs_retry)
    cancel = jobs_sub.add_parser("cancel", help="stop a job after its current call (what it made stays)")
    cancel.add_argument("id", type=int)
    cancel.set_defaults(func=_jobs_cancel)

    key = ctl_sub.add_parser("ssh-key", help="the control plane's SSH public key (put into every new VM)")
    key.set_defaults(func=_ssh_key)


def _wait_flags(parser) -> None:
    parser.add_argument("--wait", action="store_true", help="show the steps as they go; exit non-zero on failure")
    parser.add_argument("--timeout", type=float, default=3600)


def onboard_flags(parser) -> None:
    """The flags ``ctl onboard`` shares with ``ctl provision --onboard``."""
    parser.add_argument("--ssh-user", default="", help="default root (after provision: the VM's cloud-init user)")
    parser.add_argument("--fabric", action="append", default=[], metavar="NAME[:HCA,HCA]",
                        help="a fabric and its HCAs (repeatable); NAME alone means NAME:mlx5_0,mlx5_1; "
                             "none: an island")
    parser.add_argument("--mgmt-interface", default="", help="default eth0")
    parser.add_argument("--nvidia-smi", default="", help="path of nvidia-smi on the node (default: on PATH)")
    parser.add_argument("--ib-root", default="", help="default /sys/class/infiniband")
    parser.add_argument("--skip-gpus", action="store_true", help="a node without GPUs")
    parser.add_argument("--root", default="", help="install under this root on the node (default /)")
    parser.add_argument("--etc-dir", default="", help="default ROOT/etc/llmgw")
    parser.add_argument("--unit-dir", default="", help="default ROOT/etc/systemd/system")


def onboard_body(args) -> dict:
    body = {"fabrics": args.fabric, "skip_gpus": args.skip_gpus}
    for key in ("ssh_user", "mgmt_interface", "nvidia_smi", "ib_root", "ssh_port", "host_key_fingerprint",
                "reinstall", "agent_server", "root", "etc_dir", "unit_dir"):
        value = getattr(args, key, None)
        if value not in (None, ""):
            body[key] = value
    return body


def _hypervisor_options(parser) -> None:
    parser.add_argument("--ca-file", help="the CA that signed the API's certificate (PEM)")
    parser.add_argument("--node", help="Proxmox node (default: the cluster's only node)")
    parser.add_argument("--storage", help="VM disks go here (default local-lvm)")
    parser.add_argument("--image", help="cloud image volume, e.g. local:import/noble.qcow2")
    parser.add_argument("--bridge", help="default vmbr0")
    parser.add_argument("--pool")
    parser.add_argument("--ciuser", help="cloud-init user (default ubuntu)")
    parser.add_argument("--nameserver")
    parser.add_argument("--ssh-key-file", action="append", default=[], help="operator's public key (repeatable)")


def _read(path: str, what: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise CtlError(f"cannot read the {what} {path}: {exc.strerror}") from exc


def _hypervisor_body(args) -> dict:
    body = {k: getattr(args, k) for k in ("url", "token_id") + HYPERVISOR_OPTIONS if getattr(args, k, None)}
    if args.token_secret_file:
        body["token_secret"] = _read(args.token_secret_file, "token secret file").strip()
    if args.ca_file:
        body["ca_pem"] = _read(args.ca_file, "CA file")
    if args.ssh_key_file:
        body["ssh_keys"] = "\n".join(_read(f, "SSH key file").strip() for f in args.ssh_key_file)
    return body


def _hypervisors_list(args) -> int:
    rows = api_call("GET", "/api/v1/hypervisors/")
    if args.output == "json":
        print_json(rows)
        return 0
    print_table(["name", "url", "token", "node", "storage", "image", "bridge", "pool"],
                [[h["name"], h["url"], h["token_id"], h["node"] or "-", h["storage"], h["image"], h["bridge"],
                  h["pool"] or "-"] for h in rows])
    return 0


def _hypervisors_add(args) -> int:
    row = api_call("POST", "/api/v1/hypervisors/", json={"name": args.name, **_hypervisor_body(args)})
    print(f"added hypervisor {row['name']} ({row['url']}, token {row['token_id']}); "
          f"'llmgw ctl hypervisors check {row['name']}' tries the token")
    return 0


def _hypervisors_update(args) -> int:
    body = _hypervisor_body(args)
    if not body:
        raise CtlError("nothing to change: give at least one option")
    row = api_call("PATCH", f"/api/v1/hypervisors/{args.name}/", json=body)
    print(f"updated hypervisor {row['name']}")
    return 0


def _hypervisors_remove(args) -> int:
    api_call("DELETE", f"/api/v1/hypervisors/{args.name}/")
    print(f"removed hypervisor {args.name}")
    return 0


def _hypervisors_check(args) -> int:
    params = {"vmid": args.vmid} if args.vmid else None
    result = api_call("POST", f"/api/v1/hypervisors/{args.name}/check/", params=params)
    if not result["reachable"]:
        raise CtlError(f"{args.name}: {result['error']}")
    print(f"{args.name}: Proxmox VE {result['version']}, the token logs in")
    if not result["missing"]:
        print("the token holds every privilege a provisioning job needs")
        return 0
    print("the token lacks:")
    for missing in result["missing"]:
        print(f"  {missing['privilege']} on {missing['path']}")
    return 1


def _provision(args) -> int:
    node = args.node or args.name_flag
    if not node:
        raise CtlError("name the node: llmgw ctl provision NODE (or --name NODE)")
    if args.node and args.name_flag and args.node != args.name_flag:
        raise CtlError(f"two node ids given ({args.node} and --name {args.name_flag}): a node has one name")
    body = {"node": node, "vmid": args.vmid, "ip": args.ip, "gateway": args.gateway, "hypervisor": args.hypervisor,
            "cores": args.cores, "memory": args.memory, "disk": args.disk, "nameserver": args.nameserver}
    if args.onboard:
        body["onboard"] = onboard_body(args)
    elif args.fabric or args.ssh_user or args.skip_gpus:
        raise CtlError("--fabric, --ssh-user and --skip-gpus are for onboarding: add --onboard")
    job = api_call("POST", "/api/v1/jobs/provision/", json=body)
    print(f"job {job['id']}: provision {job['node_name']} on {job['hypervisor']} (VMID {job['params']['vmid']})"
          + ("; onboarding follows" if args.onboard else ""))
    if not args.wait:
        return 0
    rc = _watch(job["id"], args.timeout)
    if rc == 0 and args.onboard:
        follow = api_call("GET", "/api/v1/jobs/", params={"node": job["node_name"]})
        onboarding = [j for j in follow if j["kind"] == "onboard"]
        if not onboarding:
            raise CtlError("the VM is made but no onboarding job followed; 'llmgw ctl events' says why")
        print(f"job {onboarding[0]['id']}: onboard {job['node_name']}")
        rc = _watch(onboarding[0]["id"], args.timeout)
    return rc


def _watch(job_id: int, timeout: float) -> int:
    """Print each step as it changes, with its new log lines under it."""
    deadline = time.monotonic() + timeout
    seen_status: dict[int, str] = {}
    seen_lines: dict[int, int] = {}
    while True:
        job = api_call("GET", f"/api/v1/jobs/{job_id}/")
        total = len(job["steps"])
        for step in job["steps"]:
            i = step["index"]
            new_lines = step["log"][seen_lines.get(i, 0):]
            if step["status"] != seen_status.get(i, "pending") or new_lines:
                if step["status"] != seen_status.get(i):
                    print(f"[{i + 1}/{total}] {step['title']}: {step['status']}", flush=True)
                for line in new_lines:
                    print(f"      {line['line']}", flush=True)
                seen_status[i], seen_lines[i] = step["status"], len(step["log"])
        if job["status"] == "succeeded":
            key = job["ssh_host_key_fingerprint"]
            print(f"job {job_id} succeeded" + (f"; host key {key} pinned" if key else ""))
            return 0
        if job["status"] in ("failed", "cancelled"):
            raise CtlError(f"job {job_id} {job['status']}: {job['status_reason']}")
        if time.monotonic() > deadline:
            raise CtlError(f"job {job_id} is still {job['status']} after {timeout:.0f}s; "
                           f"'llmgw ctl jobs show {job_id}' follows it")
        time.sleep(1)


def _jobs_list(args) -> int:
    params = {k: v for k, v in (("status", args.status), ("node", args.node)) if v}
    jobs = api_call("GET", "/api/v1/jobs/", params=params)
    if args.output == "json":
        print_json(jobs)
        return 0
    rows = []
    for job in jobs:
        current = next((s["title"] for s in job["steps"] if s["status"] not in ("done", "skipped")), "")
        rows.append([job["id"], job["kind"], job["node_name"], job["hypervisor"] or "-", job["status"],
                     job["created_at"][:19].replace("T", " "), job["status_reason"] or current])
    print_table(["job", "kind", "node", "hypervisor", "state", "created", "step / why"], rows)
    return 0


def _jobs_show(args) -> int:
    job = api_call("GET", f"/api/v1/jobs/{args.id}/")
    if args.output == "json":
        print_json(job)
        return 0
    print(f"job {job['id']}: {job['kind']} {job['node_name']} on {job['hypervisor'] or '-'}: {job['status']}"
          + (f" ({job['status_reason']})" if job["status_reason"] else ""))
    print("params: " + ", ".join(f"{k}={v}" for k, v in job["params"].items()))
    if job["ssh_host_key"]:
        print(f"host key: {job['ssh_host_key_fingerprint']}")
    for step in job["steps"]:
        start = (step["started_at"] or "")[11:19]
        end = (step["finished_at"] or "")[11:19]
        print(f"[{step['index'] + 1}] {step['title']}: {step['status']} {start}{' - ' + end if end else ''}")
        for line in step["log"]:
            print(f"      {line['at'][11:19]} {line['line']}")
    return 0


def _jobs_retry(args) -> int:
    job = api_call("POST", f"/api/v1/jobs/{args.id}/retry/")
    print(f"job {job['id']} queued again")
    return _watch(job["id"], args.timeout) if args.wait else 0


def _jobs_cancel(args) -> int:
    job = api_call("POST", f"/api/v1/jobs/{args.id}/cancel/")
    print(f"job {job['id']} cancelled; what it made stays (remove the VM in Proxmox if it is not wanted)")
    return 0


def _ssh_key(args) -> int:
    key = api_call("GET", "/api/v1/hypervisors/ssh-key/")
    print(key["public_key"])
    return 0
