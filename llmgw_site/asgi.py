import os

# The web process: Django runs each request in a thread of its own, so its
# connections come from a bounded pool (settings.LLMGW_DB_POOL_MAX).
os.environ["LLMGW_ROLE"] = "web"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_application = get_asgi_application()


def _with_static(app):
    from django.conf import settings

    if not settings.DEBUG and not settings.LLMGW_SERVE_STATIC:
        return app
    # The embedded default has no front proxy: serve the static files (the
    # admin's, Swagger UI's) from the installed apps, as runserver does.
    # Production may put nginx in front and set LLMGW_SERVE_STATIC=0.
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    return ASGIStaticFilesHandler(app)


# /v1 and /metrics skip Django's middleware and per-request thread (gateway.asgi).
from gateway.asgi import with_gateway  # noqa: E402 - needs the settings configured above

application = with_gateway(_with_static(django_application))
