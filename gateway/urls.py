"""The URLconf of the lean /v1 and /metrics handler (``gateway.asgi``)."""

from django.urls import path

from . import views

urlpatterns = [
    path("v1/models", views.models),
    path("v1/models/<path:model>", views.model_detail),
    path("v1/chat/completions", views.chat_completions),
    path("v1/completions", views.completions),
    path("v1/embeddings", views.embeddings),
    path("metrics", views.metrics),
]
