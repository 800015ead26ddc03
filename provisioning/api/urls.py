from rest_framework.routers import SimpleRouter

from .views import HypervisorViewSet, JobViewSet

router = SimpleRouter(trailing_slash=True)
router.register("hypervisors", HypervisorViewSet, basename="hypervisor")
router.register("jobs", JobViewSet, basename="job")

urlpatterns = router.urls
