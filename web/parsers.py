"""How the operator REST API reads JSON (a site-wide DRF setting).

DRF's parser turns only ``ValueError`` into a 400: a body nested deeper than
Python's recursion limit raised ``RecursionError`` and became an HTML 500.
Every endpoint of the operator API takes a JSON object: an array, a string or
a number at the top is refused here, once, rather than reaching a view that
reads it as a mapping (``PATCH /api/v1/models/NAME/`` with ``[]`` was a 500).
"""

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body is nested too deeply") from None
        if not isinstance(data, dict):
            raise ParseError(f"the body must be a JSON object, not a JSON {_json_kind(data)}")
        return data


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array"
