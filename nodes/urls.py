from django.urls import path

from . import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("nodes/<str:name>/", views.node_detail, name="dashboard-node"),
]
