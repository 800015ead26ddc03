"""WSGI entry of the agent API listener: its own URLconf, no middleware."""

import os

os.environ["LLMGW_ROLE"] = "agent-api"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()
