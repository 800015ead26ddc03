from rest_framework.routers import SimpleRouter

from .views import ApiKeyViewSet

router = SimpleRouter(trailing_slash=True)
router.register("keys", ApiKeyViewSet, basename="apikey")

urlpatterns = router.urls
