"""The one base of the REST API's viewsets (/api/v1/), as NetBox's `NetBoxModelViewSet` is.

A resource's viewset inherits `PlatformViewSet` (or `PlatformModelViewSet` /
`PlatformReadOnlyViewSet`, the usual DRF mixins on it) and sets only what is its own:
`serializer_class`, `queryset` or `get_queryset` (through its app's `access_*` helpers when
rows belong to a tenant), `permission_classes` when "any signed-in caller" is not the rule,
and `perform_create` / `perform_update` / `perform_destroy` calling its app's `do_*` actions.

- Authentication: a session (console, portal), a platform API key or a staff token
  (`tenants.api.authentication`). A key acts for its tenant and is never staff, so a route
  for staff (`IsAdminUser`, or the writes of `ReadAnyWriteStaff`) refuses every key; a staff
  token acts as its staff user (its `read` scope: safe methods only).
- Errors: `exception_handler`, REST_FRAMEWORK's EXCEPTION_HANDLER, answers what the actions
  raise in DRF's format: Django's ValidationError 400 (a field's errors under its name),
  PermissionDenied 403, Http404 404, a delete of a row others still refer to (ProtectedError,
  RestrictedError) 409. Never a 500 for bad input; a bug is still a 500, logged with its
  traceback and signalled as Django does, but answered in JSON (`PlatformViewSet.
  handle_exception`). A path no route matches is a JSON 404 too (`unrouted`).
- Input PostgreSQL would refuse is refused first, as a 400 naming the field or parameter:
  text with a NUL byte, anywhere in the body or the query (`refuse_nul_bytes`); a page size or
  offset beyond what a query can carry (`BoundedLimitOffsetPagination`); an instant outside
  2000-2100 (`BoundedDateTimeField`, `check_instant`). Integers in bodies are bounded by their
  model field's own range (DRF's ModelSerializer reads it from the field's validators).
- Ids: a row's id in a path or a body is ASCII digits (config.ids.row_id): anything else that
  int() would read, " 2" or "２", finds no row (a 404 in a path, `RowIdField`'s 400 in a body).
- Numbers: JSON's true and false are not numbers (`FloatField`; serializers of models stand on
  `PlatformModelSerializer`, which makes their fields with it).
- Writes: `PlatformModelViewSet` never saves a serializer. A resource that does not route a
  write through an action fails loudly instead of writing around it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, TypeVar

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.signals import got_request_exception
from django.db import OperationalError, models
from django.db.models import ProtectedError, RestrictedError
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.authentication import SessionAuthentication
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from config.ids import LARGEST_ID, row_id
from config.nul import NUL_MESSAGE, has_nul, names_with_nul
from tenants.api.authentication import ApiKeyAuthentication, StaffTokenAuthentication

logger = logging.getLogger("django.request")

_Row = TypeVar("_Row", bound=models.Model)

# Session first: an anonymous caller is answered 403, as before keys were accepted.
# REST_FRAMEWORK's DEFAULT_AUTHENTICATION_CLASSES names the same, for the views outside it.
AUTHENTICATION = [SessionAuthentication, ApiKeyAuthentication, StaffTokenAuthentication]


class ReadAnyWriteStaff(permissions.BasePermission):
    """Anyone signed in reads (what their queryset shows them); only staff write."""

    def has_permission(self, request: Request, view: Any) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        return request.method in permissions.SAFE_METHODS or bool(request.user.is_staff)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler, which already maps Http404 and PermissionDenied, plus the actions'
    ValidationError: `{"field": [...]}` when it names fields, `[...]` when it does not; and a
    delete the database's foreign keys refuse, a 409 naming what still refers to the row; a
    body past DATA_UPLOAD_MAX_MEMORY_SIZE, a 413."""
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else exc.messages
        exc = ValidationError(detail)
    if isinstance(exc, RequestDataTooBig):
        too_big = f"The request body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes."
        return Response({"detail": too_big}, status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
    if isinstance(exc, ProtectedError | RestrictedError):
        rows = exc.protected_objects if isinstance(exc, ProtectedError) else exc.restricted_objects
        kinds = sorted({str(row._meta.verbose_name_plural) for row in rows})
        conflict = f"Still referred to by {', '.join(kinds)}; remove those first."
        return Response({"detail": conflict}, status=status.HTTP_409_CONFLICT)
    return drf_exception_handler(exc, context)


@csrf_exempt  # a write to no route is a 404, whatever its cookies: no CSRF page first
def unrouted(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
    """What a path under /api/v1/ that no route matches answers: DRF's 404, not an HTML page
    (with a hint where only the trailing slash is missing: every route ends with one)."""
    if not request.path.endswith("/"):
        return JsonResponse({"detail": "Not found. Paths under /api/v1/ end with '/'."}, status=404)
    return JsonResponse({"detail": "Not found."}, status=404)


# ---------------------------------------------------------------- input PostgreSQL refuses


def refuse_nul_bytes(request: Request) -> None:
    """A 400 naming each field or query parameter whose text holds a NUL byte, which
    PostgreSQL stores in neither text nor jsonb (it would be a DataError, a 500)."""
    errors = {
        name: [NUL_MESSAGE]
        for source in (request.query_params, request.data)
        for name in names_with_nul(source)
    }
    if errors:
        raise ValidationError(errors)


EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(2101, 1, 1, tzinfo=UTC)
INSTANT_RANGE_MESSAGE = "Must be between 2000-01-01 and 2100-12-31 (UTC)."


def check_instant(value: datetime) -> datetime:
    """`value` in UTC, or DRF's ValidationError when it falls outside 2000-2100: a platform
    that started in the 2020s has nothing before, and year 9999 plus an offset overflows."""
    try:
        instant = value.astimezone(UTC)
    except OverflowError:
        raise ValidationError(INSTANT_RANGE_MESSAGE) from None
    if not EARLIEST <= instant < LATEST:
        raise ValidationError(INSTANT_RANGE_MESSAGE)
    return instant


class BoundedDateTimeField(serializers.DateTimeField):
    """DRF's date-time, within 2000-2100 and answered in UTC whatever offset it came with."""

    def to_internal_value(self, value: Any) -> datetime:
        return check_instant(super().to_internal_value(value))


class RowIdField(serializers.PrimaryKeyRelatedField):
    """DRF's primary-key relation, taking only an id (config.ids.row_id): the queryset's int()
    read " 2", "２" and 2.0 as row 2. A bool is DRF's own "incorrect type"."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, bool) and row_id(data) is None:
            self.fail("does_not_exist", pk_value=data)
        return super().to_internal_value(data)


class IdField(serializers.IntegerField):
    """A row's id given as a value, not a relation (a query's `?key=`): ASCII digits within a
    bigint (config.ids.row_id), where DRF's IntegerField reads " 2", "２", "+2" and "2.0"."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(min_value=1, max_value=LARGEST_ID, **kwargs)

    def to_internal_value(self, data: Any) -> int:
        pk = row_id(data)
        if pk is None:
            self.fail("invalid")
        return super().to_internal_value(pk)


class FloatField(serializers.FloatField):
    """DRF's float, but JSON's true and false are no numbers: float(True) is 1.0, so a
    `"ttl_hours": true` was a one-hour token and `"params_b": true` a model of 1 billion."""

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool):
            self.fail("invalid")
        return super().to_internal_value(data)


# The base of every model serializer of the API, as NetBox's NetBoxModelSerializer: the fields
# it makes from a model's take a number only as a number (`FloatField`; DRF's own IntegerField
# and DecimalField already refuse a bool) and a relation only by an id (`RowIdField`).
# Serializers declare these two by name where they declare such fields. A comment, not a
# docstring: drf-spectacular would give a docstring to every schema built on it.
class PlatformModelSerializer(serializers.ModelSerializer[_Row]):
    serializer_field_mapping = {
        **serializers.ModelSerializer.serializer_field_mapping,
        models.FloatField: FloatField,
    }
    serializer_related_field = RowIdField


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """`?limit` and `?offset` as DRF reads them, but a value no query can carry (10**30 is
    "bigint out of range") is a 400 naming it rather than a 500; limit is capped at 1000."""

    max_limit = 1000
    max_offset = 2**63 - 1

    def get_limit(self, request: Request) -> int | None:
        self._check(request, self.limit_query_param, self.max_offset)
        return super().get_limit(request)

    def get_offset(self, request: Request) -> int:
        self._check(request, self.offset_query_param, self.max_offset)
        return super().get_offset(request)

    @staticmethod
    def _check(request: Request, name: str, largest: int) -> None:
        given = request.query_params.get(name, "").strip()
        if given.isdigit() and int(given) > largest:
            raise ValidationError(
                {name: [f"Ensure this value is less than or equal to {largest}."]}
            )


class PlatformViewSet(viewsets.GenericViewSet[Any]):
    authentication_classes = AUTHENTICATION
    permission_classes = [permissions.IsAuthenticated]
    pagination_class = BoundedLimitOffsetPagination

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        if any(has_nul(value) for value in kwargs.values()):
            raise NotFound()  # no row's key holds a NUL, and PostgreSQL cannot look for one
        lookup = kwargs.get(self.lookup_url_kwarg or self.lookup_field)
        if self.lookup_field == "pk" and lookup is not None and row_id(lookup) is None:
            raise NotFound()  # not an id (config.ids): int() read " 2" and "２" as row 2
        refuse_nul_bytes(request)

    def handle_exception(self, exc: Exception) -> Response:
        try:
            return super().handle_exception(exc)
        except OperationalError:
            raise  # config.middleware.DatabaseUnavailableMiddleware answers it: a 503
        except Exception:
            # What exception_handler does not answer is a bug: logged with its traceback and
            # signalled (error trackers and the test client listen) as Django's own handler
            # would, but answered in JSON like every other /api error.
            logger.exception("Internal Server Error: %s", self.request.path)
            got_request_exception.send(sender=type(self), request=self.request._request)
            return Response({"detail": "Server error."}, status=500)


class PlatformReadOnlyViewSet(mixins.RetrieveModelMixin, mixins.ListModelMixin, PlatformViewSet):
    pass


class PlatformModelViewSet(
    mixins.CreateModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    mixins.ListModelMixin,
    PlatformViewSet,
):
    # Each write is the resource's own do_* call, which sets `serializer.instance` to the row
    # it wrote. (A comment, not a docstring: drf-spectacular would print it on every route.)

    def perform_create(self, serializer: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} creates through a do_* action.")

    def perform_update(self, serializer: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} updates through a do_* action.")

    def perform_destroy(self, instance: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} deletes through a do_* action.")
