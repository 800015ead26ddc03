from django.urls import include, path

urlpatterns = [
    path("agent/v1/", include("nodes.api.agent_urls")),
]
