"""The one scan for NUL characters (config/nul.py) that the REST API and the pages share:
PostgreSQL stores no NUL in text or jsonb, so each is refused before a save would be a 500."""

from __future__ import annotations

from typing import Any

import pytest
from django.apps import apps
from django.db import models
from django.http import QueryDict

from config import api, middleware
from config.nul import has_nul, names_with_nul, validate_no_nul


@pytest.mark.parametrize(
    "value",
    ["a\x00b", ["ok", "a\x00b"], ("a\x00b",), {"a\x00b": "key"}, {"k": {"deep": ["\x00"]}}],
)
def test_a_nul_in_text_or_anywhere_inside_an_object_or_list_is_found(value: Any) -> None:
    assert has_nul(value)


@pytest.mark.parametrize("value", ["plain", "\\u0000", ["a", {"b": "c"}], 0, None, True, 1.5])
def test_values_without_a_nul_pass(value: Any) -> None:
    assert not has_nul(value)


def test_each_field_of_a_query_a_form_or_a_body_holding_a_nul_is_named() -> None:
    form = QueryDict("ok=1&bad=a%00b&tags=x&tags=y%00&na%00me=z")
    assert names_with_nul(form) == ["bad", "tags", "na\x00me"]
    assert names_with_nul({"ok": 1, "labels": {"zone": "a\x00"}}) == ["labels"]
    assert names_with_nul(["a\x00"]) == ["non_field_errors"]
    assert names_with_nul(None) == []


def test_the_api_and_the_pages_use_the_one_scan_and_say_the_same() -> None:
    assert api.has_nul is middleware.has_nul is has_nul
    assert api.names_with_nul is middleware.names_with_nul is names_with_nul
    assert api.NUL_MESSAGE.encode() in middleware.NUL_PAGE


def test_every_json_field_of_the_project_refuses_a_nul() -> None:
    """A form that parses JSON text (the admin's) makes a NUL of a `\\u0000` escape."""
    fields = [
        field
        for app in ("tenants", "registry", "serving", "metering")
        for model in apps.get_app_config(app).get_models()
        for field in model._meta.get_fields()
        if isinstance(field, models.JSONField)
    ]
    assert len(fields) >= 10  # the walk found the project's fields
    for field in fields:
        assert validate_no_nul in field.validators, f"{field.model.__name__}.{field.name}"
