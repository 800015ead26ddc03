from django.contrib.admin.views.decorators import staff_member_required
from django.http import Http404
from django.shortcuts import render

from . import selectors


@staff_member_required
def dashboard(request):
    nodes = list(selectors.node_list())
    seen = selectors.node_last_seen(nodes)
    rows = [{"node": n, "age": selectors.age_seconds(seen[n.name])} for n in nodes]
    return render(
        request,
        "nodes/dashboard.html",
        {"rows": rows, "events": selectors.event_list()[:50], "fabrics": selectors.fabric_list()},
    )


@staff_member_required
def node_detail(request, name: str):
    node = selectors.node_get(name=name)
    if node is None:
        raise Http404(f"no node named {name}")
    seen = selectors.node_last_seen([node])[node.name]
    return render(
        request,
        "nodes/node_detail.html",
        {"node": node, "age": selectors.age_seconds(seen), "events": selectors.event_list(node=name)[:100]},
    )
