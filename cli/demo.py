"""``llmgw demo``: llmgw on its embedded default with a simulated cluster of
four nodes in two fabrics, a sample catalog, and what to try.

Imported only once Django is set up (see ``cli/env.py``).
"""

from __future__ import annotations

import json

import sys
from pathlib import Path

import yaml
from django.conf import settings

from gateway import snippets
from gateway.models import ApiKey
from gateway.services import key_create
from nodes.choices import NodeStatus
from nodes.models import Node
from pki.services import bundle_write, cert_issue_client
from replicas.catalog import catalog_apply

from .env import child_env, llmgw_command
from .processes import stopped_on_exit
from .simcluster import SEEDS_NODES, SimCluster, SimNode
from .up import first_run, process_commands
from .wait import wait_until

SAMPLE_CATALOG = """\
models:
  - name: llama-70b-sim
    engine: sim
    model: /models/llama-70b
    nodes: 2
    gpus_per_node: 4
    replicas: 2
  - name: qwen-7b-sim
    engine: sim
    model: /models/qwen-7b
    nodes: 1
    gpus_per_node: 1
    replicas: 2
"""


def _cluster(*, host: str, agent_port: int) -> SimCluster:
    base = Path(settings.DATA_DIR) / "sim"
    base.mkdir(parents=True, exist_ok=True)
    return SimCluster(base=base, env=child_env(settings.DATA_DIR), agent_url=f"https://{host}:{agent_port}")


def _issue(name: str, out: Path) -> None:
    if not (out / f"{name}.pem").exists():
        bundle_write(issued=cert_issue_client(node_id=name), out_dir=out)


def _stop(cluster: SimCluster) -> None:
    print("\nllmgw demo: stopping the control plane, then the simulated nodes", flush=True)
    cluster.stop()
    print("llmgw demo: stopped", flush=True)


def run_demo(*, host: str, web_port: int, agent_port: int) -> int:
    lines = first_run(host=host)
    cluster = _cluster(host=host, agent_port=agent_port)
    with stopped_on_exit(lambda: _stop(cluster)):
        _start(cluster, host=host, web_port=web_port, agent_port=agent_port)
        _print_guide(cluster, lines, host=host, web_port=web_port)
        exited = cluster.processes.wait(interval=0.5)
        if exited is None:
            return 0
        code = cluster.processes.procs[exited].returncode
        print(f"llmgw demo: {exited} exited with status {code}; see {cluster.processes.log_path(exited)}",
              file=sys.stderr)
        return 1


def _start(cluster: SimCluster, *, host: str, web_port: int, agent_port: int) -> None:
    for name, argv in process_commands(host=host, web_port=web_port, agent_port=agent_port, agent_workers=1).items():
        cluster.processes.start(name, argv)
    for node in SEEDS_NODES:
        cluster.add_node(SimNode(node.name, node.addr, node.gpus, node.fabric, node.hcas), issue_cert=_issue)
        cluster.start_agent(node.name)
    # Place the catalog once every node is in, so that replicas spread across
    # fabrics and nodes as they would on a running cluster.
    names = [n.name for n in SEEDS_NODES]
    try:
        wait_until(lambda: Node.objects.filter(name__in=names, status=NodeStatus.READY).count() == len(names),
                   timeout=90, interval=0.5, message="the four simulated nodes to register")
    except TimeoutError as exc:
        print(f"llmgw demo: {exc}; see the agents' logs under {cluster.base / 'nodes'}", file=sys.stderr)
    (cluster.base / "catalog.yaml").write_text(SAMPLE_CATALOG)
    catalog_apply(entries=yaml.safe_load(SAMPLE_CATALOG)["models"], prune=False)


def _print_guide(cluster: SimCluster, lines: list[str], *, host: str, web_port: int) -> None:
    catalog = cluster.base / "catalog.yaml"
    # Under the current directory (make demo: var/demo), said as the README says it.
    try:
        relative = settings.DATA_DIR.relative_to(Path.cwd())
        data, data_env = str(relative), f"$PWD/{relative}"
    except ValueError:
        data = data_env = str(settings.DATA_DIR)
    web = f"http://{host}:{web_port}"
    llmgw = llmgw_command()
    key = "(a key named 'demo' exists from an earlier run: llmgw ctl keys create NAME -q makes another)"
    if not ApiKey.objects.filter(name="demo").exists():
        key = key_create(name="demo").key
    curl = "  " + snippets.curl(base_url=web, model="qwen-7b-sim").replace("\n", "\n  ")
    python = str(Path(llmgw).with_name("python")) if llmgw != "llmgw" else "python"
    openai = f"  {python} - <<'PY'\n" + "".join(
        "  " + line + "\n" for line in snippets.openai_python(base_url=web, model="qwen-7b-sim").splitlines()
    ) + "  PY"
    print("\n".join(lines))
    print(f"""
llmgw demo is up: four simulated nodes, node01+node02 on ib-a and node03+node04 on ib-b, 8 GPUs each,
each a real agent on its own loopback address with its own certificate.

  web UI      {web}/            (log in as 'admin', its password in {data}/admin-password; docs/ui.md)
              cluster {web}/  replicas {web}/replicas/  events {web}/events/
              gateway {web}/gateway/  provisioning {web}/provisioning/  admin {web}/admin/
  catalog     {catalog}

Watch it (in another shell):
  export LLMGW_DATA_DIR={data_env} LLMGW_URL={web}
  {llmgw} ctl nodes
  {llmgw} ctl replicas
  {llmgw} ctl events

Try a failure: kill node02 (its agent and its engines):
  {llmgw} demo kill node02 --data-dir {data}
After {settings.LLMGW_NODE_GRACE:.0f} s without a heartbeat (LLMGW_NODE_GRACE) node02 is lost: its llama-70b-sim replica
fails and comes back on ib-b, once the 1-GPU qwen-7b-sim replica in its way on node03 has moved to node01
(replacement first: no request fails). {llmgw} ctl events tells each step.

Bring node02 back (it registers again, empty):
  {llmgw} demo revive node02 --data-dir {data}

A GPU fails: Xid 79 (fallen off the bus) on GPU 0 of node01, through its fake NVML's event API:
  {llmgw} demo gpu-fail node01 0 --data-dir {data}
Within a telemetry interval GPU 0 is quarantined (red on the cluster page, 'llmgw ctl gpus --node node01'),
the replica on it fails and is rebuilt on GPUs in service; the Events name the Xid and what it means.
After the 'repair' (a reset), an operator puts it back in service:
  {llmgw} demo gpu-fail node01 0 --reset --data-dir {data}
  {llmgw} ctl gpus clear node01 0

Then try a drain: node03's replicas move to ib-a, one at a time, each replacement ready before its original stops:
  {llmgw} ctl drain node03 --wait

Send a request through the gateway, with the API key made for this demo (shown once):
  export LLMGW_KEY={key}
{curl}

or with the openai package (in llmgw's environment; elsewhere: pip install openai):
{openai}
Ctrl-C stops everything.
""", flush=True)


def _sim_node(name: str, *, host: str, agent_port: int) -> SimCluster | None:
    cluster = _cluster(host=host, agent_port=agent_port)
    node_dir = cluster.base / "nodes" / name
    if not (node_dir / "agent.yaml").exists():
        known = sorted(p.name for p in (cluster.base / "nodes").glob("*") if (p / "agent.yaml").exists())
        print(f"llmgw: no simulated node {name} under {cluster.base}"
              + (f" (there are: {', '.join(known)})" if known else " (is the demo's data dir right?)"), file=sys.stderr)
        return None
    cluster.nodes[name] = SimNode(name, "", dir=node_dir)
    return cluster


def kill_node(*, name: str, host: str = "127.0.0.1", agent_port: int = 7443) -> int:
    cluster = _sim_node(name, host=host, agent_port=agent_port)
    if cluster is None:
        return 1
    killed = cluster.kill_node(name)
    print(f"killed {name}: processes {', '.join(map(str, killed)) or 'none were running'}")
    return 0


def gpu_fail(*, name: str, index: int, reset: bool = False, xid: int = 79, host: str = "127.0.0.1",
             agent_port: int = 7443) -> int:
    """Xid ``xid`` (79: fallen off the bus) on a simulated node's GPU, or its reset."""
    from agent.nvml_fake import GPUS_FILE, inject_fault

    cluster = _sim_node(name, host=host, agent_port=agent_port)
    if cluster is None:
        return 1
    node_dir = cluster.nodes[name].dir
    try:
        count = len(json.loads((node_dir / GPUS_FILE).read_text())["gpus"])
    except (OSError, ValueError, KeyError):
        print(f"llmgw: {name} has no fake NVML ({node_dir / GPUS_FILE}); was it made by an older llmgw?",
              file=sys.stderr)
        return 1
    if not 0 <= index < count:
        print(f"llmgw: {name} has GPUs 0-{count - 1}, not {index}", file=sys.stderr)
        return 1
    if reset:
        inject_fault(node_dir, {"gpu": index, "reset": True})
        print(f"GPU {index} of {name} was reset: back on the bus. It stays quarantined until an operator "
              f"clears it: llmgw ctl gpus clear {name} {index}")
        return 0
    inject_fault(node_dir, {"gpu": index, "xid": xid})
    print(f"GPU {index} of {name}: Xid {xid} raised through its NVML event API. Watch: llmgw ctl gpus --node {name}; "
          "llmgw ctl events")
    return 0


def revive_node(*, name: str, host: str = "127.0.0.1", agent_port: int = 7443) -> int:
    """Start a killed node's agent again, on its own configuration; the demo
    stops it with the others."""
    cluster = _sim_node(name, host=host, agent_port=agent_port)
    if cluster is None:
        return 1
    running = cluster.agent_pid(name)
    if running is not None:
        print(f"{name} is running already (agent pid {running})")
        return 0
    proc = cluster.start_agent(name)
    print(f"revived {name}: agent pid {proc.pid}; it registers again and comes back empty "
          f"(llmgw ctl nodes; its log: {cluster.nodes[name].dir / 'agent.log'})")
    return 0
