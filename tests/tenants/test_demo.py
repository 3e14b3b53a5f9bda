"""The demo data of the tenants app."""

from __future__ import annotations

from typing import Any

import pytest

from tenants import demo
from tenants.actions import api_key_for_raw_key
from tenants.models import ApiKey


@pytest.mark.django_db
def test_the_demo_key_stays_the_same_and_is_recreated_when_its_row_is_gone(
    redis_client: Any, django_capture_on_commit_callbacks: Any
) -> None:
    details: dict[str, Any] = {"extra": {}}
    with django_capture_on_commit_callbacks(execute=True):
        demo.seed(details)
        first = details["extra"]["Demo API key (acme)"]
        ApiKey.objects.all().delete()
        demo.seed(details)
    assert details["extra"]["Demo API key (acme)"] == first
    key = api_key_for_raw_key(first)
    assert key is not None and key.tenant.slug == "acme"
    assert redis_client.exists(f"apikey:{key.secret_hash}")
