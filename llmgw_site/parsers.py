"""How the operator REST API reads JSON (a site-wide DRF setting).

DRF's parser turns only ``ValueError`` into a 400: a body nested deeper than
Python's recursion limit raised ``RecursionError`` and became an HTML 500.
"""

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body is nested too deeply") from None
