"""Operator API errors: JSON with a message a person can act on."""

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from nodes import outages
from nodes.exceptions import InvalidTransition, NotFound


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
