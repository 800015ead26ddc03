"""The lock order (docs/architecture.md) under load: heartbeats carrying
member reports (some of which fail replicas), nodes declared lost and coming
back, reconciles, drains started, cancelled and ended by uncordon, and
scaling, all at once from several threads, each with its own PostgreSQL
connection, for a bounded while. Nothing may deadlock or raise anything but
a refusal a person would get (a drain of a lost node), and no invariant may
break: no GPU or port allocated twice, no member on a GPU another holds."""

from __future__ import annotations

import os
import random
import threading
import time
import traceback
from collections import Counter, defaultdict

import pytest
from django.db import close_old_connections, connection

from core.exceptions import InvalidTransition
from nodes.choices import NodeStatus
from nodes.heartbeat import node_heartbeat
from nodes.models import Node
from nodes.services import node_transition, node_uncordon
from replicas import drain, reconcile, rollout, services
from replicas.catalog import catalog_apply, model_scale
from replicas.choices import PLACED, MemberState
from replicas.models import CatalogEntry, Drain, GpuAllocation, Member, PortAllocation, Replica
from replicas.selectors import members_wanted
from tests.control_plane import heartbeat_payload

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("no_reconcile_enqueue")]

SECONDS = float(os.environ.get("LLMGW_LOCK_ORDER_SECONDS", "20"))
NODES = [f"node{i:02d}" for i in range(1, 7)]


@pytest.fixture(autouse=True)
def _no_waits(settings):
    """The reconcile runs in a thread of its own here, not through a worker."""
    settings.LLMGW_ROUTING_SETTLE = 0
    settings.LLMGW_STOP_GRACE = 0


class Load:
    def __init__(self) -> None:
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.refusals: Counter = Counter()
        self.done: Counter = Counter()
        self.payloads = {name: heartbeat_payload(name, gpus=8) for name in NODES}

    def run(self, name: str, step) -> threading.Thread:
        def loop():
            rng = random.Random(name)
            try:
                while not self.stop.is_set():
                    try:
                        step(rng)
                        self.done[name] += 1
                    except InvalidTransition as exc:  # a refusal an operator would get: not a fault
                        self.refusals[type(exc).__name__] += 1
                    except Exception:
                        self.errors.append(f"{name}: {traceback.format_exc()}")
                        close_old_connections()
            finally:
                connection.close()

        thread = threading.Thread(target=loop, name=name, daemon=True)
        thread.start()
        return thread

    def heartbeat(self, node: str, rng: random.Random) -> None:
        """What the node's agent would say: its wanted members running and
        healthy, now and then one exited (its replica fails)."""
        engines = []
        for member in members_wanted().filter(node__name=node):  # the others, its agent stopped
            exited = rng.random() < 0.02
            engines.append({
                "member": member.member_id, "replica": str(member.replica_id), "rank": member.rank,
                "state": "exited" if exited else "running", "pid": 1000 + member.pk,
                "exit_code": 1 if exited else None, "healthy": not exited,
                "log_tail": ["NCCL error: remote process exited"] if exited else [],
            })
        node_heartbeat(node_name=node, payload={**self.payloads[node], "engines": engines})


ENTRIES = {
    "pair": {"name": "pair", "engine": "sim", "model": "/m/pair", "nodes": 2, "gpus_per_node": 4, "replicas": 2},
    "single": {"name": "single", "engine": "sim", "model": "/m/single", "nodes": 1, "gpus_per_node": 2, "replicas": 3},
}


def test_heartbeats_reconciles_and_drains_do_not_deadlock():
    load = Load()
    for name in NODES:
        node_heartbeat(node_name=name, payload=load.payloads[name])
    assert Node.objects.filter(status=NodeStatus.READY).count() == len(NODES)
    catalog_apply(entries=list(ENTRIES.values()))
    reconcile.replicas_reconcile()

    def heartbeats(nodes):
        def step(rng):
            for node in nodes:
                load.heartbeat(node, rng)
        return step

    def reconciles(rng):
        reconcile.replicas_reconcile()

    def drains(rng):
        node = rng.choice(NODES)
        status = Node.objects.get(name=node).status
        if status == NodeStatus.DRAINED:
            node_uncordon(node_name=node)
            return
        started = drain.drain_start(node_name=node)
        time.sleep(rng.uniform(0.05, 0.4))  # the scenario: other threads act between a drain's steps
        drain.drain_step(drain_id=started.pk)
        ending = rng.random()
        if ending < 0.35:
            drain.drain_cancel(drain_id=started.pk)
            node_uncordon(node_name=node)
        elif ending < 0.7:
            node_uncordon(node_name=node)

    def lost_and_back(rng):
        # The sweep's two steps; the node's next heartbeat brings it back.
        node = rng.choice(NODES)
        if node_transition(node_name=node, to=NodeStatus.LOST, expected=NodeStatus.READY, reason="test") is not None:
            if rng.random() < 0.5:  # else: the follow-up was lost, the reconcile does it
                services.replicas_node_lost(node_name=node)
        time.sleep(rng.uniform(0.5, 1.5))

    def scaling(rng):
        model_scale(name=rng.choice(["pair", "single"]), replicas=rng.randint(1, 3))
        time.sleep(rng.uniform(0.2, 0.8))

    def rollouts(rng):
        # A launch change (a rollout), steered: paused, resumed, undone.
        name = rng.choice(["pair", "single"])
        entry = ENTRIES[name]
        catalog_apply(entries=[{**e, "replicas": CatalogEntry.objects.get(name=n).replicas}
                               for n, e in ENTRIES.items() if n != name]
                      + [{**entry, "replicas": CatalogEntry.objects.get(name=name).replicas,
                          "args": ["--token-delay", f"0.0{rng.randint(1, 9)}"]}])
        time.sleep(rng.uniform(0.1, 0.5))
        for steer in rng.sample([rollout.rollout_pause, rollout.rollout_resume, rollout.rollout_undo], 2):
            try:
                steer(name=name, actor="lock-order")
            except InvalidTransition:
                pass  # nothing to pause or resume now: a 409, not an error
            time.sleep(rng.uniform(0.1, 0.4))

    threads = [
        load.run("heartbeats-a", heartbeats(NODES[0::3])),
        load.run("heartbeats-b", heartbeats(NODES[1::3])),
        load.run("heartbeats-c", heartbeats(NODES[2::3])),
        load.run("reconcile-1", reconciles),
        load.run("reconcile-2", reconciles),
        load.run("drains", drains),
        load.run("lost", lost_and_back),
        load.run("scaling", scaling),
        load.run("rollouts", rollouts),
    ]
    time.sleep(SECONDS)  # the scenario: this much mixed load, then every thread must stop
    load.stop.set()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), f"{thread.name} is stuck"

    if load.errors:
        kinds = Counter(e.strip().splitlines()[-1][:200] for e in load.errors)
        contexts = Counter(line.strip() for e in load.errors for line in e.splitlines() if "CONTEXT" in line)
        pytest.fail(f"{len(load.errors)} error(s): {dict(kinds)}; {dict(contexts)}; the first:\n{load.errors[0]}")
    for thread in threads:
        assert load.done[thread.name] > 0, f"{thread.name} never completed a step ({dict(load.done)})"

    # Settle: every node heard again, the reconcile run twice.
    for name in NODES:
        load.heartbeat(name, random.Random(0))
    reconcile.replicas_reconcile()
    reconcile.replicas_reconcile()
    _assert_invariants()


def _assert_invariants():
    gpus = list(GpuAllocation.objects.values_list("gpu_id", flat=True))
    assert len(gpus) == len(set(gpus)), "a GPU allocated twice"
    ports = list(PortAllocation.objects.values_list("node_id", "port"))
    assert len(ports) == len(set(ports)), "a port allocated twice"
    held = defaultdict(list)
    for member in Member.objects.exclude(state=MemberState.GONE).select_related("node"):
        for index in member.gpus:
            held[(member.node.name, index)].append(member.member_id)
        allocated = sorted(GpuAllocation.objects.filter(member=member).values_list("gpu__index", flat=True))
        assert allocated == sorted(member.gpus), f"{member.member_id}: allocations {allocated} != {member.gpus}"
    shared = {k: v for k, v in held.items() if len(v) > 1}
    assert not shared, f"GPUs held by two members: {shared}"
    assert not Member.objects.filter(replica__status__in=PLACED, node__status=NodeStatus.LOST).exclude(
        state=MemberState.GONE).exists(), "a placed replica left on a lost node"
    active = Counter(Drain.objects.filter(status__in=["running", "blocked"]).values_list("node_id", flat=True))
    assert all(count == 1 for count in active.values())


def _waiting_on_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return bool(row) and row[0] == "Lock"


def test_a_scale_down_takes_its_replicas_in_ascending_pk():
    """The deadlock a CI run found: a placement locks pending replicas in
    ascending pk while the model's reconcile stopped them newest first, each
    holding the one before. Now, while the scale-down waits for the oldest
    (held here, as a placement would), it holds none of the newer ones."""
    from django.db import connections

    catalog_apply(entries=[{**ENTRIES["single"], "replicas": 3}])
    model = CatalogEntry.objects.get(name="single")
    reconcile.model_reconcile(model_id=model.pk)  # three pending replicas: no node to place them on
    oldest, *newer = Replica.objects.filter(model=model).order_by("pk").values_list("pk", flat=True)
    assert len(newer) == 2
    model_scale(name="single", replicas=0)

    holder = connections.create_connection("default")
    holder.set_autocommit(False)
    done = threading.Event()
    failure: list[str] = []

    def scale_down():
        try:
            reconcile.model_reconcile(model_id=model.pk)
        except Exception:
            failure.append(traceback.format_exc())
        finally:
            connection.close()
            done.set()

    worker = None
    try:
        with holder.cursor() as cursor:
            cursor.execute("SELECT id FROM replicas_replica WHERE id = %s FOR NO KEY UPDATE", [oldest])
        pids: list[int] = []

        def scale_down_pid():
            connection.ensure_connection()
            pids.append(connection.connection.info.backend_pid)
            scale_down()

        worker = threading.Thread(target=scale_down_pid, daemon=True)
        worker.start()
        deadline = time.monotonic() + 10
        while not (pids and _waiting_on_lock(pids[0])):
            assert time.monotonic() < deadline and not done.is_set(), f"the scale-down never waited: {failure}"
            time.sleep(0.02)
        with holder.cursor() as cursor:
            for pk in newer:  # free: the scale-down holds none of them while it waits
                cursor.execute("SELECT id FROM replicas_replica WHERE id = %s FOR NO KEY UPDATE NOWAIT", [pk])
    finally:
        holder.rollback()
        holder.close()
        if worker is not None:
            worker.join(timeout=30)
    assert done.is_set() and not failure, failure
    assert set(Replica.objects.filter(model=model).values_list("status", flat=True)) == {"stopped"}
