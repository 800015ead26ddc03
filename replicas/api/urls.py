from django.urls import path
from rest_framework.routers import SimpleRouter

from .views import CatalogApplyView, DrainViewSet, ModelViewSet, ReplicaViewSet, WeightsView

router = SimpleRouter(trailing_slash=True)
router.register("models", ModelViewSet, basename="model")
router.register("replicas", ReplicaViewSet, basename="replica")
router.register("drains", DrainViewSet, basename="drain")

urlpatterns = [path("catalog/apply/", CatalogApplyView.as_view(), name="catalog-apply"),
               path("weights/", WeightsView.as_view(), name="weights"), *router.urls]
