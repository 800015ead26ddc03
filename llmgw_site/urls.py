from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

urlpatterns = [
    path("", include("ui.urls")),
    path("admin/", admin.site.urls),
    path("api/v1/", include("nodes.api.urls")),
    path("api/v1/", include("core.api.urls")),
    path("api/v1/", include("pki.api.urls")),
    path("api/v1/", include("replicas.api.urls")),
    path("api/v1/", include("gateway.api.urls")),
    path("api/v1/", include("provisioning.api.urls")),
    path("api/v1/", include("accounts.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
]

handler404 = "web.errors.not_found"
