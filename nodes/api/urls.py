from rest_framework.routers import SimpleRouter

from .views import FabricViewSet, NodeViewSet

router = SimpleRouter(trailing_slash=True)
router.register("nodes", NodeViewSet, basename="node")
router.register("fabrics", FabricViewSet, basename="fabric")

urlpatterns = router.urls
