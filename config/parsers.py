"""The REST API's JSON parser (settings.REST_FRAMEWORK's DEFAULT_PARSER_CLASSES): a module of
its own, since DRF imports it while its views are still importing (config.api imports them)."""

from __future__ import annotations

import json
import math
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class JsonBodyParser(JSONParser):
    """DRF's JSON parser, but a body nested past Python's recursion limit and a number past a
    double's range (1e400, which would be stored as Infinity and fail the answer's JSON) are
    its 400 parse errors, not 500s."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            return json.loads(
                stream.read().decode(encoding),
                parse_constant=_no_constant,
                parse_float=_finite_float,
            )
        except RecursionError:
            raise ParseError("JSON parse error - nested too deeply.") from None
        except ValueError as error:
            raise ParseError(f"JSON parse error - {error}") from None


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of range")
    return value
