"""Row ids as clients write them, in /api paths, page URLs and form fields: ASCII digits within
a bigint, and nothing else. Python's int() is laxer (it reads " 2", "２", "+2" and "2_0" as
numbers, and True as 1), so a lookup through it found row 2, or 20, from text that is no id.

Page routes take ids with Django's `<int:...>` converter ([0-9]+, the same digits); /api paths
(config.api.PlatformViewSet.initial), /api bodies (config.api.RowIdField), the `access_*`
helpers and the pages' forms read the ids they are given with `row_id`, or find the row with
`one_row`."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.http import Http404

LARGEST_ID = 2**63 - 1


def row_id(value: object) -> int | None:
    """`value` as a row id (an int, or text of ASCII digits, within a bigint); None when it is
    not one, which finds no row."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and value.isascii() and value.isdigit():
        number = int(value)
    else:
        return None
    return number if 0 <= number <= LARGEST_ID else None


def one_row(queryset: QuerySet[Any], value: object, what: str) -> Any:
    """The row of `queryset` whose id `value` is; a 404 "No such {what}." when `value` is no
    id or names no row there."""
    pk = row_id(value)
    found = None if pk is None else queryset.filter(pk=pk).first()
    if found is None:
        raise Http404(f"No such {what}.")
    return found
