from django.urls import path

from . import views

urlpatterns = [path("replicas/", views.replica_overview, name="dashboard-replicas")]
