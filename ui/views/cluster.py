from django.http import JsonResponse
from django.shortcuts import render

from nodes.choices import NodeStatus

from ..cluster import Filters, cluster_grid
from ..cluster_live import cluster_live
from .access import viewer


@viewer("nodes.view_node", "replicas.view_replica")
def cluster(request):
    filters = Filters.from_query(request.GET)
    context = {"cluster": cluster_grid(filters), "filters": filters, "states": NodeStatus.values}
    return render(request, "ui/cluster.html", context)


@viewer("nodes.view_node", "replicas.view_replica")
def cluster_grid_partial(request):
    filters = Filters.from_query(request.GET)
    return render(request, "ui/partials/cluster_grid.html", {"cluster": cluster_grid(filters), "filters": filters})


@viewer("nodes.view_node", "replicas.view_replica")
def cluster_grid_data(request):
    """The live update: the grid as compact data, rendered by ui/static/ui/cluster.js."""
    return JsonResponse(cluster_live(Filters.from_query(request.GET)), json_dumps_params={"separators": (",", ":")})
