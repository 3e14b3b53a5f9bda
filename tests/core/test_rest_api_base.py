"""The REST API's one base (config/api.py): every /api/v1/ viewset stands on it, none writes
around an action, and what the actions raise comes back in DRF's format, never as a 500."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import PermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework import mixins, serializers

from config.api import (
    AUTHENTICATION,
    PlatformModelSerializer,
    PlatformModelViewSet,
    PlatformViewSet,
    exception_handler,
)
from tenants.api.authentication import ApiKeyAuthentication


def _routed(patterns: list[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            yield from _routed(pattern.url_patterns, route)
        elif isinstance(pattern, URLPattern):
            yield route, pattern.callback


def api_viewsets() -> dict[str, type]:
    """Each viewset routed under /api/v1/, by name (DRF's view functions carry `actions`)."""
    return {
        callback.cls.__name__: callback.cls
        for route, callback in _routed(get_resolver("config.urls").url_patterns)
        if route.startswith("api/v1/") and getattr(callback, "actions", None)
    }


def test_every_api_viewset_stands_on_the_base_and_takes_sessions_and_api_keys() -> None:
    viewsets = api_viewsets()
    # One resource of each app at least, so an empty walk cannot pass.
    assert {"TenantViewSet", "ModelViewSet", "GpuPoolViewSet", "PriceSheetViewSet"} <= set(viewsets)
    for name, cls in viewsets.items():
        assert issubclass(cls, PlatformViewSet), name
        assert cls.authentication_classes == AUTHENTICATION, name
    assert ApiKeyAuthentication in AUTHENTICATION


def project_serializers() -> list[type[serializers.BaseSerializer[Any]]]:
    """Every serializer class of the apps (their modules are imported with the routes)."""
    api_viewsets()
    found, pending = [], [serializers.BaseSerializer]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] in {"config", "tenants", "registry", "serving", "metering"}:
            found.append(cls)
    return found


def nested_fields(field: Any) -> Iterator[Any]:
    yield field
    for inner in ("child", "child_relation"):
        if getattr(field, inner, None) is not None:
            yield from nested_fields(getattr(field, inner))
    if isinstance(field, serializers.Serializer):
        for each in field.fields.values():
            yield from nested_fields(each)


def test_no_serializer_takes_true_for_a_number_or_a_row_id_that_is_no_id() -> None:
    """DRF's FloatField reads true as 1.0, and its PrimaryKeyRelatedField " 2" as row 2: every
    model serializer stands on the base that makes its fields with config.api's own, and no
    serializer declares DRF's."""
    classes = project_serializers()
    assert len(classes) > 20  # the walk found the apps' serializers
    for cls in classes:
        if issubclass(cls, serializers.ModelSerializer) and cls is not PlatformModelSerializer:
            assert issubclass(cls, PlatformModelSerializer), cls.__qualname__
        if cls is PlatformModelSerializer:
            continue
        for field in nested_fields(cls()):
            kind = type(field)
            assert kind not in (serializers.FloatField, serializers.PrimaryKeyRelatedField), (
                f"{cls.__qualname__}: {field.field_name or field} is DRF's {kind.__name__}"
            )


WRITES = [
    ("post", mixins.CreateModelMixin.create, "perform_create"),
    ("put", mixins.UpdateModelMixin.update, "perform_update"),
    ("delete", mixins.DestroyModelMixin.destroy, "perform_destroy"),
]


def test_each_openapi_component_describes_its_own_rows_not_the_base_it_stands_on() -> None:
    """drf-spectacular takes a serializer's docstring, inherited ones included, as its
    component's description: the base's words were on 27 of them."""
    components = openapi_components()
    assert "Tenant" in components
    inherited = [name for name, c in components.items() if "NetBox" in c.get("description", "")]
    assert inherited == []


def openapi_components() -> dict[str, Any]:
    from drf_spectacular.generators import SchemaGenerator

    document: dict[str, Any] = SchemaGenerator().get_schema(request=None, public=True)
    return dict(document["components"]["schemas"])


@pytest.mark.parametrize(("method", "generic_handler", "hook"), WRITES)
def test_no_api_viewset_leaves_a_write_to_serializer_save(
    method: str, generic_handler: Any, hook: str
) -> None:
    """A write a viewset allows is its own handler or its own `perform_*` (a do_* call)."""
    for name, cls in api_viewsets().items():
        if not issubclass(cls, PlatformModelViewSet) or method not in cls.http_method_names:
            continue
        own_handler = getattr(cls, generic_handler.__name__) is not generic_handler
        own_hook = getattr(cls, hook) is not getattr(PlatformModelViewSet, hook)
        assert own_handler or own_hook, f"{name} {method.upper()}"


def test_the_base_refuses_to_save_a_serializer_itself() -> None:
    with pytest.raises(NotImplementedError, match="through a do_\\* action"):
        PlatformModelViewSet().perform_create(serializer=None)


def test_a_validation_error_naming_fields_is_a_400_by_field() -> None:
    response = exception_handler(DjangoValidationError({"name": ["Taken."]}), {})
    assert response is not None
    assert (response.status_code, response.data) == (400, {"name": ["Taken."]})


def test_a_validation_error_naming_no_field_is_a_400_list() -> None:
    response = exception_handler(DjangoValidationError("Stop its deployments first."), {})
    assert response is not None
    assert (response.status_code, response.data) == (400, ["Stop its deployments first."])


def test_permission_denied_and_not_found_keep_their_message() -> None:
    denied = exception_handler(PermissionDenied("Only platform staff may do this."), {})
    missing = exception_handler(Http404("No such model."), {})
    assert denied is not None and missing is not None
    assert (denied.status_code, denied.data) == (
        403,
        {"detail": "Only platform staff may do this."},
    )
    assert (missing.status_code, missing.data) == (404, {"detail": "No such model."})


def test_a_bug_is_not_disguised_as_a_client_error() -> None:
    assert exception_handler(KeyError("oops"), {}) is None


def test_the_handler_is_the_one_drf_uses() -> None:
    from rest_framework.settings import api_settings

    assert api_settings.EXCEPTION_HANDLER is exception_handler


def test_a_bug_in_a_viewset_is_a_json_500_and_still_signalled(
    django_user_model: Any, db: None
) -> None:
    from django.core.signals import got_request_exception
    from rest_framework.test import APIRequestFactory, force_authenticate

    class Broken(PlatformViewSet):
        def list(self, request: Any) -> Any:
            raise KeyError("oops")

    signalled: list[Any] = []

    def record(sender: Any, request: Any = None, **kwargs: Any) -> None:
        signalled.append(request)

    request = APIRequestFactory().get("/api/v1/broken/")
    force_authenticate(request, django_user_model(username="ops"))
    got_request_exception.connect(record)
    try:
        response = Broken.as_view({"get": "list"})(request)
    finally:
        got_request_exception.disconnect(record)
    assert (response.status_code, response.data) == (500, {"detail": "Server error."})
    assert len(signalled) == 1


def test_a_database_outage_in_a_viewset_still_reaches_the_503_middleware(
    django_user_model: Any, db: None
) -> None:
    from django.db import OperationalError
    from rest_framework.test import APIRequestFactory, force_authenticate

    class Stalled(PlatformViewSet):
        def list(self, request: Any) -> Any:
            raise OperationalError("canceling statement due to statement timeout")

    request = APIRequestFactory().get("/api/v1/stalled/")
    force_authenticate(request, django_user_model(username="ops"))
    with pytest.raises(OperationalError):
        Stalled.as_view({"get": "list"})(request)
