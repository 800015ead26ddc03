"""Who did it: the name an action's Event gives its author, the same from
the web pages, the REST API and so the CLI."""

from __future__ import annotations


def actor(request) -> str:
    """'user NAME' for the user behind a request (a Django or DRF request)."""
    return f"user {request.user.get_username()}"
