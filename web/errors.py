"""Operator API errors: JSON with a message a person can act on."""

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import JsonResponse
from django.views import defaults
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from core import outages
from core.exceptions import InvalidTransition, NotFound


def unavailable_response(exc: Exception) -> Response | None:
    """503 with Retry-After and the dependency's name, when ``exc`` says one is away."""
    dependency = outages.unavailable(exc)
    if dependency is None:
        return None
    outages.DEPENDENCIES[dependency].failed(exc)
    return Response(
        {"detail": outages.unavailable_message(dependency, exc), "dependency": dependency},
        status=status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": str(outages.RETRY_AFTER)},
    )


def exception_handler(exc, context):
    unavailable = unavailable_response(exc)
    if unavailable is not None:
        return unavailable
    if isinstance(exc, InvalidTransition):
        return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
    if isinstance(exc, NotFound):
        return Response({"detail": str(exc)}, status=status.HTTP_404_NOT_FOUND)
    if isinstance(exc, DjangoValidationError):
        return Response({"detail": "; ".join(exc.messages)}, status=status.HTTP_400_BAD_REQUEST)
    return drf_exception_handler(exc, context)


def not_found(request, exception):
    """Django's 404 for a URL no route matches (``handler404``): JSON under
    ``/api/``, as every other answer of the operator API, the HTML page elsewhere."""
    if request.path_info.startswith("/api/"):
        return JsonResponse(
            {"detail": f"no such URL: {request.path_info!r} names nothing in the operator API (see /api/docs/)"},
            status=404,
        )
    return defaults.page_not_found(request, exception)
