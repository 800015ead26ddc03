from rest_framework.routers import SimpleRouter

from .views import FabricViewSet, GpuHealthViewSet, NodeViewSet

router = SimpleRouter(trailing_slash=True)
router.register("nodes", NodeViewSet, basename="node")
router.register("fabrics", FabricViewSet, basename="fabric")
router.register("gpus", GpuHealthViewSet, basename="gpu")

urlpatterns = router.urls
