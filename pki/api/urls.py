from rest_framework.routers import SimpleRouter

from .views import CertificateViewSet

router = SimpleRouter(trailing_slash=True)
router.register("certificates", CertificateViewSet, basename="certificate")

urlpatterns = router.urls
