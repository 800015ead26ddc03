from django.contrib.admin.views.decorators import staff_member_required
from django.shortcuts import render

from . import selectors


@staff_member_required
def replica_overview(request):
    return render(
        request,
        "replicas/overview.html",
        {"models": selectors.model_list(), "replicas": selectors.replica_list(), "drains": selectors.drain_list()[:20]},
    )
