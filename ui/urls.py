from django.contrib.auth import views as auth_views
from django.urls import path

from .views import cluster, events, gateway, nodes, onboarding, provisioning, replicas, tokens

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="ui/login.html"), name="ui-login"),
    path("logout/", auth_views.LogoutView.as_view(), name="ui-logout"),
    path("", cluster.cluster, name="ui-cluster"),
    path("cluster/grid/", cluster.cluster_grid_partial, name="ui-cluster-grid"),
    path("nodes/<str:name>/", nodes.node_page, name="ui-node"),
    path("nodes/<str:name>/live/", nodes.node_live, name="ui-node-live"),
    path("nodes/<str:name>/cordon/", nodes.node_cordon, name="ui-node-cordon"),
    path("nodes/<str:name>/uncordon/", nodes.node_uncordon, name="ui-node-uncordon"),
    path("nodes/<str:name>/drain/", nodes.node_drain, name="ui-node-drain"),
    path("nodes/<str:name>/drain/cancel/", nodes.node_drain_cancel, name="ui-node-drain-cancel"),
    path("nodes/<str:name>/revoke/", nodes.node_revoke, name="ui-node-revoke"),
    path("nodes/<str:name>/reonboard/", onboarding.node_reonboard, name="ui-node-reonboard"),
    path("replicas/", replicas.replicas_page, name="ui-replicas"),
    path("replicas/live/", replicas.replicas_live, name="ui-replicas-live"),
    path("replicas/<int:replica_id>/", replicas.replica_page, name="ui-replica"),
    path("models/<str:name>/scale/", replicas.model_scale, name="ui-model-scale"),
    path("catalog/", replicas.catalog_page, name="ui-catalog"),
    path("catalog/apply/", replicas.catalog_apply, name="ui-catalog-apply"),
    path("events/", events.events_page, name="ui-events"),
    path("events/live/", events.events_live, name="ui-events-live"),
    path("gateway/", gateway.gateway_page, name="ui-gateway"),
    path("gateway/keys/", gateway.key_create, name="ui-key-create"),
    path("gateway/keys/<str:name>/revoke/", gateway.key_revoke, name="ui-key-revoke"),
    path("tokens/", tokens.tokens_page, name="ui-tokens"),
    path("tokens/new/", tokens.token_create, name="ui-token-create"),
    path("tokens/<str:prefix>/revoke/", tokens.token_revoke, name="ui-token-revoke"),
    path("provisioning/", provisioning.provisioning_page, name="ui-provisioning"),
    path("provisioning/live/", provisioning.jobs_live, name="ui-jobs-live"),
    path("provisioning/vm/", provisioning.job_new_vm, name="ui-job-new-vm"),
    path("provisioning/onboard/", onboarding.job_onboard, name="ui-job-onboard"),
    path("provisioning/jobs/<int:job_id>/retry/", provisioning.job_retry, name="ui-job-retry"),
    path("provisioning/jobs/<int:job_id>/cancel/", provisioning.job_cancel, name="ui-job-cancel"),
]
