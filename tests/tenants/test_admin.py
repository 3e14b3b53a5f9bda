"""The Django admin writes through tenants.actions: its checks show on the form, and the keys'
Redis records follow on commit (before, a tenant suspended or a quota lowered in the admin
reached the gateways only at the next five-minute republish, and a blocked pattern RE2
cannot run was stored and skipped by every gateway)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from django.contrib.auth import get_user_model
from django.test import Client

from tenants.actions import do_create_api_key
from tenants.keys import key_record_name, principal_from_record
from tenants.models import ApiKey, KeyQuotaOverride, Quota, Tenant
from tests.admin_pages import admin_form
from tests.tenants.conftest import user

Capture = Callable[..., Any]


@pytest.fixture
def root(acme: Tenant) -> Client:
    client = Client()
    client.force_login(
        get_user_model().objects.create_user("root", is_staff=True, is_superuser=True)
    )
    return client


@pytest.fixture
def key(acme: Tenant) -> ApiKey:
    made, _ = do_create_api_key(acme, "ci", user("acme-owner"), ("inference",), ())
    return made


def gateway_view(client: redis.Redis, key: ApiKey) -> Any:
    raw = client.get(key_record_name(key.secret_hash))
    assert raw is not None, "no key record in Redis"
    return principal_from_record(raw, key.secret_hash)


def test_suspending_a_tenant_in_the_admin_reaches_the_gateways_on_commit(
    root: Client,
    acme: Tenant,
    key: ApiKey,
    redis_client: redis.Redis,
    django_capture_on_commit_callbacks: Capture,
) -> None:
    url = f"/admin/tenants/tenant/{acme.pk}/change/"
    form = admin_form(root, url)
    with django_capture_on_commit_callbacks(execute=True):
        reply = root.post(url, {**form, "status": "suspended"})
    assert reply.status_code == 302, reply.context["adminform"].form.errors
    assert Tenant.objects.get(pk=acme.pk).status == "suspended"
    assert gateway_view(redis_client, key).tenant_status == "suspended"


def test_a_pattern_re2_cannot_run_is_refused_on_the_admin_form(root: Client, acme: Tenant) -> None:
    url = f"/admin/tenants/tenant/{acme.pk}/change/"
    form = admin_form(root, url)
    reply = root.post(url, {**form, "blocked_patterns": '["secret(?!ary)"]'})
    assert reply.status_code == 200
    errors = reply.context["adminform"].form.errors
    assert "RE2" in errors["blocked_patterns"][0]
    assert Tenant.objects.get(pk=acme.pk).blocked_patterns == []


def test_a_tenant_added_in_the_admin_gets_its_quota_and_keeps_its_slug(root: Client) -> None:
    reply = root.get("/admin/tenants/tenant/add/")
    form = {
        **admin_form(root, "/admin/tenants/tenant/add/"),
        "slug": "initech",
        "name": "Initech",
        "status": "active",
        "allowed_regions": "[]",
        "blocked_patterns": "[]",
    }
    assert reply.status_code == 200
    reply = root.post("/admin/tenants/tenant/add/", form)
    assert reply.status_code == 302, reply.content
    created = Tenant.objects.get(slug="initech")
    assert Quota.objects.filter(tenant=created).exists()
    change = root.get(f"/admin/tenants/tenant/{created.pk}/change/")
    assert "slug" not in change.context["adminform"].form.fields  # shown, not editable


def test_lowering_a_quota_or_a_key_override_in_the_admin_reaches_the_gateways(
    root: Client,
    acme: Tenant,
    key: ApiKey,
    redis_client: redis.Redis,
    django_capture_on_commit_callbacks: Capture,
) -> None:
    quota = Quota.objects.get(tenant=acme)
    url = f"/admin/tenants/quota/{quota.pk}/change/"
    with django_capture_on_commit_callbacks(execute=True):
        reply = root.post(url, {**admin_form(root, url), "tokens_per_minute": 1234})
    assert reply.status_code == 302, reply.content
    assert gateway_view(redis_client, key).limits.tokens_per_minute == 1234

    with django_capture_on_commit_callbacks(execute=True):
        reply = root.post(
            "/admin/tenants/keyquotaoverride/add/",
            {"api_key": key.pk, "tokens_per_minute": 99},
        )
    assert reply.status_code == 302, reply.content
    assert gateway_view(redis_client, key).limits.tokens_per_minute == 99

    override = KeyQuotaOverride.objects.get(api_key=key)
    with django_capture_on_commit_callbacks(execute=True):
        reply = root.post(f"/admin/tenants/keyquotaoverride/{override.pk}/delete/", {"post": "yes"})
    assert reply.status_code == 302, reply.content
    assert gateway_view(redis_client, key).limits.tokens_per_minute == 1234
    assert root.get("/admin/tenants/quota/add/").status_code == 403


def test_keys_and_tenants_are_not_deleted_nor_members_changed_in_the_admin(
    root: Client, acme: Tenant, key: ApiKey, redis_client: redis.Redis
) -> None:
    """A key deleted as a row left its Redis record live (no tombstone); a tenant deleted so
    left all of them; a membership inline could leave a tenant without an owner."""
    assert root.post(f"/admin/tenants/apikey/{key.pk}/delete/", {"post": "yes"}).status_code == 403
    listed = root.post(
        "/admin/tenants/apikey/",
        {"action": "delete_selected", "_selected_action": [key.pk], "post": "yes"},
    )
    assert listed.status_code in (200, 302)
    assert ApiKey.objects.filter(pk=key.pk).exists()
    assert root.post(f"/admin/tenants/tenant/{acme.pk}/delete/", {"post": "yes"}).status_code == (
        403
    )
    assert Tenant.objects.filter(pk=acme.pk).exists()

    url = f"/admin/tenants/tenant/{acme.pk}/change/"
    form = admin_form(root, url)
    owner_role = next(name for name, value in form.items() if value == "owner")
    root.post(url, {**form, owner_role: "viewer"})
    assert acme.memberships.filter(role="owner").count() == 1
