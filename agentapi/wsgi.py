"""WSGI entry of the agent API listener: its own URLconf, no middleware."""

import os

os.environ["LLMGW_ROLE"] = "agent-api"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

from django.core.wsgi import get_wsgi_application  # noqa: E402

_django = get_wsgi_application()


def application(environ, start_response):
    """Django's application, with the length of a body known in full sent as
    ``Content-Length``: without it (no middleware adds one here) gunicorn
    sends every answer chunked, in three writes instead of two."""
    held = []
    response = _django(environ, lambda status, headers, exc_info=None: held.append((status, headers, exc_info)))
    status, headers, exc_info = held[0]
    if getattr(response, "streaming", True) is False and not response.has_header("Content-Length"):
        headers.append(("Content-Length", str(len(response.content))))
    start_response(status, headers, exc_info)
    return response
