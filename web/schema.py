"""The operator API's OpenAPI schema: what drf-spectacular infers, plus the
error answers every view can give (a site-wide DRF setting).

The answers are those of ``web.errors.exception_handler``, DRF and the
site's middleware: 400 for input it refuses (a field's errors, a body that is
not a JSON object, a NUL byte in the path or the query), 401/403 without a
valid token or the permission, 404 for a name that does not exist, 409 for a
change the object's state does not allow, 415 for a body that is not JSON.
A body that refuses unknown keys (``core.strict``) says so:
``additionalProperties: false``.
"""

from __future__ import annotations

from drf_spectacular import openapi
from rest_framework import serializers

from core.strict import is_strict

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class ErrorSerializer(serializers.Serializer):
    """An error: ``detail`` says what is wrong in words a person can act on;
    a refused input may instead name each field with its errors
    (``{"replicas": ["Ensure this value is greater than or equal to 0."]}``)."""

    detail = serializers.CharField(required=False)
    errors = serializers.ListField(child=serializers.CharField(), required=False)


ERRORS = {
    "400": "the input is refused: the body names what is wrong (per field, or in 'detail')",
    "401": "no valid token (send 'Authorization: Bearer <token>')",
    "403": "the token's user lacks the permission this needs",
    "404": "nothing of that name or id (in the path, or named by the body)",
    "409": "the object's current state does not allow this change",
    "415": "the body is not JSON",
}


class AutoSchema(openapi.AutoSchema):
    def _map_serializer(self, serializer, direction, bypass_extensions=False):
        schema = super()._map_serializer(serializer, direction, bypass_extensions)
        if is_strict(serializer) and schema.get("type") == "object":
            # core.strict: a key the body does not declare is refused by name.
            schema["additionalProperties"] = False
        return schema

    def _error_codes(self) -> list[str]:
        codes = ["400", "401", "403"]
        if "{" in self.path or self.method in WRITES:
            codes.append("404")  # a write's body names objects too (the node of a drain)
        if self.method in WRITES:
            codes.append("409")
        if self.method in ("POST", "PUT", "PATCH"):
            codes.append("415")
        return codes

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        for code in self._error_codes():
            if code not in responses:
                response = self._get_response_for_code(ErrorSerializer, code, direction=direction)
                response["description"] = ERRORS[code]
                responses[code] = response
        return responses
