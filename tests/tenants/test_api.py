"""The tenants REST API: roles, keys shown once, and tenant isolation."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from django.apps import apps
from django.urls import URLPattern, resolve
from rest_framework.test import APIClient

from tenants.actions import do_create_api_key
from tenants.api import urls as tenant_urls
from tenants.models import ApiKey, Membership, Tenant
from tests.tenants.conftest import user


def client_for(username: str) -> APIClient:
    client = APIClient()
    client.force_login(user(username))
    return client


def bearer_client(raw_key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw_key}")
    return client


@pytest.fixture
def run_on_commit(django_capture_on_commit_callbacks: Callable[..., Any]) -> Any:
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        yield callbacks


def test_a_developer_creates_a_key_and_sees_its_secret_only_once(
    acme: Tenant, run_on_commit: Any
) -> None:
    client = client_for("acme-dev")
    created = client.post(
        "/api/v1/tenants/acme/keys/", {"name": "ci", "scopes": ["inference"]}, format="json"
    )
    assert created.status_code == 201
    secret = created.json()["secret"]
    assert secret.startswith(f"sk-{created.json()['prefix']}-")
    listed = client.get("/api/v1/tenants/acme/keys/")
    shown = client.get(f"/api/v1/tenants/acme/keys/{created.json()['id']}/")
    assert secret not in listed.content.decode() + shown.content.decode()
    assert "secret" not in shown.json()


def test_a_viewer_reads_keys_but_cannot_create_one(acme: Tenant) -> None:
    client = client_for("acme-viewer")
    assert client.get("/api/v1/tenants/acme/keys/").status_code == 200
    refused = client.post("/api/v1/tenants/acme/keys/", {"name": "x", "scopes": ["inference"]})
    assert refused.status_code == 403
    assert not ApiKey.objects.exists()


def test_a_developer_cannot_mint_a_manage_key(acme: Tenant) -> None:
    response = client_for("acme-dev").post(
        "/api/v1/tenants/acme/keys/", {"name": "x", "scopes": ["manage"]}, format="json"
    )
    assert response.status_code == 403


def test_a_developer_revokes_their_own_key_but_not_an_admins(
    acme: Tenant, run_on_commit: Any
) -> None:
    own, _ = do_create_api_key(acme, "own", user("acme-dev"), ["inference"])
    admins, _ = do_create_api_key(acme, "admins", user("acme-admin"), ["inference"])
    client = client_for("acme-dev")
    assert client.post(f"/api/v1/tenants/acme/keys/{own.pk}/revoke/").status_code == 200
    assert client.post(f"/api/v1/tenants/acme/keys/{admins.pk}/revoke/").status_code == 403
    assert ApiKey.objects.get(pk=own.pk).is_revoked
    assert not ApiKey.objects.get(pk=admins.pk).is_revoked


def test_an_admin_adds_a_member_but_only_an_owner_grants_ownership(acme: Tenant) -> None:
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_user("newcomer")
    admin = client_for("acme-admin")
    url = "/api/v1/tenants/acme/members/"
    assert admin.post(url, {"username": "newcomer", "role": "owner"}).status_code == 403
    assert admin.post(url, {"username": "newcomer", "role": "developer"}).status_code == 201


def test_the_last_owner_cannot_be_removed(acme: Tenant) -> None:
    owner = Membership.objects.get(tenant=acme, role="owner")
    response = client_for("acme-owner").delete(f"/api/v1/tenants/acme/members/{owner.pk}/")
    assert response.status_code == 400
    assert Membership.objects.filter(pk=owner.pk).exists()


def test_members_read_the_quota_and_only_staff_change_it(acme: Tenant) -> None:
    owner = client_for("acme-owner")
    assert owner.get("/api/v1/tenants/acme/quota/").json()["requests_per_minute"] == 600
    assert owner.patch("/api/v1/tenants/acme/quota/", {"requests_per_minute": 9}).status_code == 403
    staff = user("acme-viewer")
    staff.is_staff = True
    staff.save()
    changed = client_for("acme-viewer").patch(
        "/api/v1/tenants/acme/quota/", {"requests_per_minute": 9}
    )
    assert changed.json()["requests_per_minute"] == 9


def test_a_manage_key_works_as_bearer_on_its_own_tenant(acme: Tenant) -> None:
    _, raw = do_create_api_key(acme, "automation", user("acme-owner"), ["manage"])
    response = bearer_client(raw).get("/api/v1/tenants/acme/members/")
    assert response.status_code == 200
    assert len(response.json()["results"]) == 4


def test_an_inference_key_is_refused_on_the_management_api(acme: Tenant) -> None:
    _, raw = do_create_api_key(acme, "app", user("acme-owner"), ["inference"])
    assert bearer_client(raw).get("/api/v1/tenants/acme/keys/").status_code == 403


def test_a_revoked_bearer_key_is_refused(acme: Tenant) -> None:
    key, raw = do_create_api_key(acme, "automation", user("acme-owner"), ["manage"])
    client = bearer_client(raw)
    client.post(f"/api/v1/tenants/acme/keys/{key.pk}/revoke/")
    assert client.get("/api/v1/tenants/acme/keys/").status_code in (401, 403)


def test_tenants_list_shows_only_the_callers_tenants(acme: Tenant, globex: Tenant) -> None:
    slugs = [
        t["slug"] for t in client_for("globex-viewer").get("/api/v1/tenants/").json()["results"]
    ]
    assert slugs == ["globex"]


def test_a_member_creating_a_tenant_is_refused_before_the_slug_is_checked(
    acme: Tenant, globex: Tenant
) -> None:
    for slug in ("globex", "no-such-tenant"):  # taken or free: the same refusal
        reply = client_for("acme-owner").post(
            "/api/v1/tenants/", {"slug": slug, "name": "x"}, format="json"
        )
        assert reply.status_code == 403
        assert "exists" not in reply.content.decode()
    assert not Tenant.objects.filter(slug="no-such-tenant").exists()


# ------------------------------------------------------------ the cross-tenant matrix

METHODS = ["get", "post", "put", "patch", "delete"]
ANY_BODY = {
    "name": "x",
    "scopes": ["manage"],
    "role": "owner",
    "username": "globex-owner",
    "requests_per_minute": 1,
    "status": "suspended",
}


def tenant_scoped_routes(acme_member: int, acme_key: int) -> dict[str, list[str]]:
    """Every tenant-scoped route name, with the URLs that reach acme's objects through it:
    acme's own URL, and acme's object ids under globex's URL."""
    return {
        "tenant-detail": ["/api/v1/tenants/acme/"],
        "tenant-quota": ["/api/v1/tenants/acme/quota/"],
        "tenant-member-list": ["/api/v1/tenants/acme/members/"],
        "tenant-member-detail": [
            f"/api/v1/tenants/acme/members/{acme_member}/",
            f"/api/v1/tenants/globex/members/{acme_member}/",
        ],
        "tenant-key-list": ["/api/v1/tenants/acme/keys/"],
        "tenant-key-detail": [
            f"/api/v1/tenants/acme/keys/{acme_key}/",
            f"/api/v1/tenants/globex/keys/{acme_key}/",
        ],
        "tenant-key-revoke": [
            f"/api/v1/tenants/acme/keys/{acme_key}/revoke/",
            f"/api/v1/tenants/globex/keys/{acme_key}/revoke/",
        ],
        "tenant-key-limits": [
            f"/api/v1/tenants/acme/keys/{acme_key}/limits/",
            f"/api/v1/tenants/globex/keys/{acme_key}/limits/",
        ],
    }


def route_methods(url: str) -> set[str]:
    return set(resolve(url).func.actions)  # type: ignore[attr-defined]


def snapshot(redis_client: Any) -> str:
    rows = {
        model.__name__: sorted(map(str, model._default_manager.values()))
        for model in apps.get_app_config("tenants").get_models()
    }
    records = {str(name): redis_client.get(name) for name in redis_client.scan_iter("apikey:*")}
    return json.dumps([rows, sorted(map(str, records.items()))])


@pytest.mark.parametrize("credentials", ["globex-owner session", "globex manage key"])
def test_globex_gets_404_on_every_acme_object_by_every_method_and_changes_nothing(
    acme: Tenant, globex: Tenant, redis_client: Any, credentials: str, run_on_commit: Any
) -> None:
    acme_key, _ = do_create_api_key(acme, "acme's", user("acme-owner"), ["inference"])
    acme_member = Membership.objects.get(tenant=acme, role="viewer")
    if credentials == "globex manage key":
        _, raw = do_create_api_key(globex, "globex's", user("globex-owner"), ["manage"])
        client = bearer_client(raw)
    else:
        client = client_for("globex-owner")
    routes = tenant_scoped_routes(acme_member.pk, acme_key.pk)
    every_route = {
        p.name for p in tenant_urls.urlpatterns if isinstance(p, URLPattern) and p.name
    } - {"tenant-list"}
    assert set(routes) == every_route, "a tenant-scoped route is missing from the matrix"

    before = snapshot(redis_client)
    answers = {
        (method, url): getattr(client, method)(url, ANY_BODY, format="json").status_code
        for urls in routes.values()
        for url in urls
        for method in METHODS
    }
    # A method the route does not have may answer 405: the same for any id, so it reveals
    # nothing. Every method the route has answers 404.
    wrong = {
        (method, url): code
        for (method, url), code in answers.items()
        if code != 404 and not (code == 405 and method not in route_methods(url))
    }
    assert wrong == {}
    assert sum(1 for (m, u) in answers if m in route_methods(u)) >= 30
    assert snapshot(redis_client) == before


# ------------------------------------------------------------ secrets never in clear


def test_a_created_key_never_appears_in_the_database_logs_or_later_responses(
    acme: Tenant, redis_client: Any, caplog: pytest.LogCaptureFixture, run_on_commit: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    client = client_for("acme-admin")
    created = client.post(
        "/api/v1/tenants/acme/keys/", {"name": "prod", "scopes": ["manage"]}, format="json"
    ).json()
    raw = created["secret"]
    secret = raw.split("-", 2)[2]
    key_id = created["id"]
    later = [
        client.get("/api/v1/tenants/acme/keys/"),
        client.get(f"/api/v1/tenants/acme/keys/{key_id}/"),
        client.patch(f"/api/v1/tenants/acme/keys/{key_id}/", {"name": "p2"}, format="json"),
        client.get(f"/api/v1/tenants/acme/keys/{key_id}/limits/"),
        bearer_client(raw).get("/api/v1/tenants/acme/keys/"),
        client.post(f"/api/v1/tenants/acme/keys/{key_id}/revoke/"),
    ]
    assert all(secret not in response.content.decode() for response in later)
    assert secret not in caplog.text
    for model in apps.get_models():
        for row in model._default_manager.values():
            assert secret not in str(row), f"secret found in {model.__name__}"
    for name in redis_client.scan_iter():
        value = redis_client.get(name) if redis_client.type(name) == b"string" else b""
        assert secret.encode() not in name + value
