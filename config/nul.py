"""NUL characters, which PostgreSQL stores in neither text nor jsonb: saving one is a DataError,
a 500. The REST API (config.api.refuse_nul_bytes), the pages (config.middleware.
NulCharactersRefused) and every JSONField (`validate_no_nul`) look for them the same way."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.core.exceptions import ValidationError

NUL_MESSAGE = "Text cannot contain NUL (\\u0000) characters."


def has_nul(value: Any) -> bool:
    """Whether `value`, or any key or item inside it (dicts, lists, tuples), is text with a NUL
    (as a JSON body's `\\u0000` escape becomes once parsed)."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(has_nul(key) or has_nul(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return any(has_nul(item) for item in value)
    return False


def validate_no_nul(value: Any) -> None:
    """The validator of every JSONField: a form that parses JSON text (the admin's) turns a
    `\\u0000` escape into a NUL, which jsonb refuses ("unsupported Unicode escape sequence")."""
    if has_nul(value):
        raise ValidationError(NUL_MESSAGE, code="nul")


def names_with_nul(data: Any) -> list[str]:
    """The fields of a query, a form or a parsed body whose name or value holds a NUL."""
    return [name for name, value in _fields(data) if has_nul(name) or has_nul(value)]


def _fields(data: Any) -> Iterator[tuple[str, Any]]:
    if hasattr(data, "lists"):  # a QueryDict: the query, or a form body
        yield from data.lists()
    elif isinstance(data, dict):
        yield from data.items()
    elif data is not None:  # a body that is not an object: named as DRF names such errors
        yield "non_field_errors", data
