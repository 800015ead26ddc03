from django.shortcuts import render

from core import selectors as core_selectors
from core.choices import EventSeverity
from core.events import event_kinds

from .access import viewer

LIMIT = 200


def _events(query):
    node = query.get("node", "").strip()[:63]
    replica = query.get("replica", "").strip()
    kind = query.get("kind", "")
    severity = query.get("severity", "")
    events = core_selectors.event_list(node=node or None, kind=kind if kind in event_kinds() else None)
    if severity in EventSeverity.values:
        events = events.filter(severity=severity)
    if replica.isdigit():
        events = events.filter(subject=f"replica/{replica}")
    filters = {"node": node, "replica": replica if replica.isdigit() else "", "kind": kind, "severity": severity}
    return events[:LIMIT], filters


@viewer("core.view_event")
def events_page(request):
    events, filters = _events(request.GET)
    return render(request, "ui/events.html", {"events": events, "filters": filters, "kinds": event_kinds(),
                                              "severities": EventSeverity.values, "limit": LIMIT})


@viewer("core.view_event")
def events_live(request):
    events, _ = _events(request.GET)
    return render(request, "ui/partials/event_list.html", {"events": events})
