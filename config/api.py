"""The one base of the REST API's viewsets (/api/v1/), as NetBox's `NetBoxModelViewSet` is.

A resource's viewset inherits `PlatformViewSet` (or `PlatformModelViewSet` /
`PlatformReadOnlyViewSet`, the usual DRF mixins on it) and sets only what is its own:
`serializer_class`, `queryset` or `get_queryset` (through its app's `access_*` helpers when
rows belong to a tenant), `permission_classes` when "any signed-in caller" is not the rule,
and `perform_create` / `perform_update` / `perform_destroy` calling its app's `do_*` actions.

- Authentication: a session (console, portal) or a platform API key
  (`tenants.api.authentication`). A key acts for its tenant and is never staff, so a route
  for staff (`IsAdminUser`, or the writes of `ReadAnyWriteStaff`) refuses every key.
- Errors: `exception_handler`, REST_FRAMEWORK's EXCEPTION_HANDLER, answers what the actions
  raise in DRF's format: Django's ValidationError 400 (a field's errors under its name),
  PermissionDenied 403, Http404 404. Never a 500.
- Writes: `PlatformModelViewSet` never saves a serializer. A resource that does not route a
  write through an action fails loudly instead of writing around it.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import mixins, permissions, viewsets
from rest_framework.authentication import SessionAuthentication
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from tenants.api.authentication import ApiKeyAuthentication

# Session first: an anonymous caller is answered 403, as before keys were accepted.
AUTHENTICATION = [SessionAuthentication, ApiKeyAuthentication]


class ReadAnyWriteStaff(permissions.BasePermission):
    """Anyone signed in reads (what their queryset shows them); only staff write."""

    def has_permission(self, request: Request, view: Any) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        return request.method in permissions.SAFE_METHODS or bool(request.user.is_staff)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler, which already maps Http404 and PermissionDenied, plus the actions'
    ValidationError: `{"field": [...]}` when it names fields, `[...]` when it does not."""
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else exc.messages
        exc = ValidationError(detail)
    return drf_exception_handler(exc, context)


class PlatformViewSet(viewsets.GenericViewSet[Any]):
    authentication_classes = AUTHENTICATION
    permission_classes = [permissions.IsAuthenticated]


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
