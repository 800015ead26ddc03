"""The node page and its actions, each through the service the REST API and
the CLI call."""

from __future__ import annotations

from django.contrib import messages
from django.db.models import Q
from django.http import Http404
from django.shortcuts import render
from django.utils import timezone

from core import selectors as core_selectors
from nodes import gpus as gpu_services, selectors as node_selectors, services as node_services
from nodes.choices import NodeEventKind
from nodes.models import GpuConflict
from pki import services as pki_services
from pki.choices import CertificateKind
from pki.models import Certificate
from replicas import drain as drain_services
from replicas.choices import DRAIN_ACTIVE, PLACED, DrainOutcome
from replicas.models import Drain, GpuAllocation, Member

from ..certificates import cert_states
from ..cluster import replica_colour
from ..gpu_charts import node_gpu_charts
from .access import actor, back, operation, viewer
from .onboarding import reonboard_context


def _by_id(item) -> int:
    return int(item[0])


def _node_context(name: str) -> dict:
    node = node_selectors.node_get(name=name)
    if node is None:
        raise Http404(f"no node named {name}")
    seen = node_selectors.node_last_seen([node])[node.name]
    holders = {
        gpu_id: (replica_id, model, replica_colour(replica_id))
        for gpu_id, replica_id, model in GpuAllocation.objects.filter(node=node).values_list(
            "gpu_id", "member__replica_id", "member__replica__model__name")
    }
    drain = Drain.objects.filter(node=node).select_related("current__model").first()
    outcomes = [] if drain is None else [
        (int(replica_id), entry) for replica_id, entry in sorted(drain.replicas.items(), key=_by_id)
    ]
    conflicts = list(
        GpuConflict.objects.filter(Q(claimant=node) | Q(gpu__node=node)).select_related("gpu__node", "claimant")
        .order_by("since", "pk")
    )
    claimed: dict[int, list[str]] = {}
    for c in conflicts:
        if c.gpu.node_id == node.pk:
            claimed.setdefault(c.gpu_id, []).append(c.claimant.name)
    members = list(
        Member.objects.filter(node=node).exclude(state="gone").select_related("replica__model").order_by("replica_id")
    )
    health = {row["index"]: row for row in node_selectors.gpu_health_list(node_name=node.name)}
    return {
        "node": node,
        "age": node_selectors.age_seconds(seen),
        "gpus": [(gpu, holders.get(gpu.id), claimed.get(gpu.id), health.get(gpu.index) if gpu.missing_since is None
                  else None) for gpu in node.gpus.all()],
        "drain": drain,
        "drain_active": drain is not None and drain.status in DRAIN_ACTIVE,
        "outcomes": outcomes,
        "conflicts": conflicts,
        "members": members,
        "waiting": [m for m in members if m.replica.status in PLACED],
        "drain_percent": 0 if drain is None else round(100 * drain.moved / max(1, drain.moved + drain.remaining)),
    }


@viewer("nodes.view_node")
def node_page(request, name: str):
    context = _node_context(name)
    certificates = Certificate.objects.filter(common_name=name, kind=CertificateKind.CLIENT).order_by("-not_after")
    context["certificates"], context["renewal"] = cert_states(certificates[:10], now=timezone.now())
    context["events"] = core_selectors.event_list(node=name)[:50]
    context["gpu_charts"], context["gpu_strips"] = node_gpu_charts(name)
    context["gpu_health_events"] = core_selectors.event_list(node=name).filter(
        kind__in=[NodeEventKind.GPU_QUARANTINED, NodeEventKind.GPU_CLEARED, NodeEventKind.GPU_XID])[:20]
    if request.user.has_perm("provisioning.run_provisioning"):
        context.update(reonboard_context(context["node"]))
    return render(request, "ui/node.html", context)


@viewer("nodes.view_node")
def node_live(request, name: str):
    return render(request, "ui/partials/node_live.html", _node_context(name))


@operation("nodes.change_node")
def node_gpu_clear(request, name: str, index: int):
    gpu = gpu_services.gpu_clear(node_name=name, index=index, actor=actor(request))
    messages.success(request, f"GPU {index} ({gpu.uuid}) of {name} is back in service: new replicas may be placed "
                              "on it. Its next readings quarantine it again if it is still failing.")
    return back(request)


@operation("nodes.change_node")
def node_cordon(request, name: str):
    node_services.node_cordon(node_name=name, actor=actor(request))
    messages.success(request, f"{name} is cordoned: nothing new is placed on it; what runs there keeps running.")
    return back(request)


@operation("nodes.change_node")
def node_uncordon(request, name: str):
    node_services.node_uncordon(node_name=name, actor=actor(request))
    messages.success(request, f"{name} is back in service: new replicas may be placed on it.")
    return back(request)


@operation("nodes.change_node")
def node_drain(request, name: str):
    drain = drain_services.drain_start(node_name=name, actor=actor(request))
    messages.success(request, f"Draining {name}: {drain.remaining} replica(s) to move, one at a time; "
                              "each replacement is ready before its original stops.")
    return back(request)


@operation("nodes.change_node")
def node_drain_cancel(request, name: str):
    active = Drain.objects.filter(node__name=name, status__in=DRAIN_ACTIVE).values_list("pk", flat=True).first()
    if active is None:
        messages.error(request, f"{name} has no drain under way: there is nothing to cancel.")
        return back(request)
    drain = drain_services.drain_cancel(drain_id=active, actor=actor(request))
    released = [f"{entry['model']} #{replica_id}" for replica_id, entry in sorted(drain.replicas.items(), key=_by_id)
                if entry.get("outcome") == DrainOutcome.RELEASED]
    text = f"Drain of {name} cancelled: {drain.moved} replica(s) moved"
    if released:
        text += "; no longer moving, and running on here: " + ", ".join(released)
    messages.success(request, text + f". {name} stays cordoned; Uncordon puts it back in service.")
    return back(request)


@operation("pki.change_certificate")
def node_revoke(request, name: str):
    try:
        rows = pki_services.cert_revoke(target=name, reason=request.POST.get("reason", "")[:255],
                                        actor=actor(request))
    except pki_services.PkiError as exc:
        messages.error(request, str(exc))
    else:
        serials = ", ".join(r.serial for r in rows)
        messages.success(request, f"Revoked {len(rows)} certificate(s) of {name} ({serials}): its agent is refused "
                                  "from now on and the node will turn lost after the grace period.")
    return back(request)
