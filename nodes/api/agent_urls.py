from django.urls import path

from . import agent_views

urlpatterns = [
    path("ping", agent_views.ping, name="agent-ping"),
    path("nodes/<str:node_id>/heartbeat", agent_views.heartbeat, name="agent-heartbeat"),
    path("nodes/<str:node_id>/desired", agent_views.desired, name="agent-desired"),
    path("nodes/<str:node_id>/certificate", agent_views.certificate, name="agent-certificate"),
]
