"""Site-wide request checks of the web process."""

from urllib.parse import unquote_to_bytes

from django.http import HttpResponse, HttpResponseBadRequest, JsonResponse

from django.utils.deprecation import MiddlewareMixin

from core import outages


class RejectNulMiddleware:
    """A NUL byte in a path or a query string can never name anything here,
    and PostgreSQL refuses it in any text value: a lookup or a filter holding
    one was a 500. Refuse it up front, saying where it was."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        for where, raw in (("path", request.path_info), ("query string", request.META.get("QUERY_STRING", ""))):
            if "\x00" in raw or b"\x00" in unquote_to_bytes(raw):
                message = f"the request's {where} holds a NUL byte (%00); no name or filter value here can"
                if request.path_info.startswith("/api/"):
                    return JsonResponse({"detail": message}, status=400)
                return HttpResponseBadRequest(message, content_type="text/plain; charset=utf-8")
        return self.get_response(request)


class DependencyUnavailableMiddleware(MiddlewareMixin):
    """A page or view that met a dependency away (the database, Redis)
    answers 503 with Retry-After saying which, not a 500. The operator API
    answers the same through its exception handler (web/errors.py).
    A hook only (no __call__ of its own): it costs nothing on the way in."""

    def process_exception(self, request, exception):
        dependency = outages.unavailable(exception)
        if dependency is None:
            return None
        outages.DEPENDENCIES[dependency].failed(exception)
        message = outages.unavailable_message(dependency, exception)
        if request.path_info.startswith("/api/"):
            response = JsonResponse({"detail": message, "dependency": dependency}, status=503)
        else:
            response = HttpResponse(message, status=503, content_type="text/plain; charset=utf-8")
        response["Retry-After"] = str(outages.RETRY_AFTER)
        return response
