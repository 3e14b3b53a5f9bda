"""Staff API tokens: created with the secret shown once, then used as automation would, with
only an `Authorization` header (no session cookie, no CSRF token), on /api and never on /v1."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from tenants.actions import do_create_api_key
from tenants.models import Tenant
from tenants.staff_token_actions import do_create_staff_token, do_revoke_staff_token
from tenants.staff_tokens import MAX_LIFETIME, StaffToken
from tests.gateway.conftest import GatewayServer, free_port
from tests.tenants.conftest import user


@pytest.fixture
def ops(db: None) -> Any:
    return get_user_model().objects.create_user("ops", is_staff=True)


@pytest.fixture
def mint(ops: Any) -> Callable[..., str]:
    """A token of `ops`, as its raw secret."""

    def make(scope: str = "write", days: int = 30, owner: Any = None) -> str:
        expires_at = timezone.now() + timedelta(days=days)
        return do_create_staff_token(owner or ops, "automation", scope, expires_at)[1]

    return make


def curl(raw_token: str) -> Client:
    """A client with nothing but the header, which enforces CSRF as a browser's request is."""
    return Client(enforce_csrf_checks=True, headers={"authorization": f"Bearer {raw_token}"})


def signed_in(someone: Any) -> APIClient:
    client = APIClient()
    client.force_login(someone)
    return client


def in_days(days: float) -> str:
    return (timezone.now() + timedelta(days=days)).isoformat()


def token_of(raw_token: str) -> StaffToken:
    return StaffToken.objects.get(prefix=raw_token.split("_")[1])


# ------------------------------------------------------------------- creating, listing


def test_staff_create_a_token_over_the_api_and_see_its_secret_only_once(ops: Any) -> None:
    client = signed_in(ops)
    created = client.post(
        "/api/v1/staff-tokens/",
        {"name": "ci-deploy", "scope": "read", "expires_at": in_days(30)},
        format="json",
    )
    assert created.status_code == 201, created.json()
    body = created.json()
    secret = body["secret"]
    assert secret.startswith(f"pst_{body['prefix']}_")
    assert body["display"] == f"pst_{body['prefix']}_…"
    assert created["Cache-Control"] == "no-store"

    listed = client.get("/api/v1/staff-tokens/")
    shown = client.get(f"/api/v1/staff-tokens/{body['id']}/")
    assert [t["prefix"] for t in listed.json()["results"]] == [body["prefix"]]
    assert secret not in listed.content.decode() + shown.content.decode()
    assert "secret" not in shown.json()
    stored = StaffToken.objects.get()
    assert stored.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert (stored.user, stored.scope, stored.name) == (ops, "read", "ci-deploy")


def test_a_staff_member_lists_only_their_own_tokens_and_gets_404_for_anothers(
    ops: Any, mint: Callable[..., str]
) -> None:
    colleague = get_user_model().objects.create_user("colleague", is_staff=True)
    theirs = token_of(mint(owner=colleague))
    mine = token_of(mint())
    client = signed_in(ops)
    listed = client.get("/api/v1/staff-tokens/").json()["results"]
    assert [t["id"] for t in listed] == [mine.pk]
    assert client.get(f"/api/v1/staff-tokens/{theirs.pk}/").status_code == 404
    assert client.post(f"/api/v1/staff-tokens/{theirs.pk}/revoke/").status_code == 404
    theirs.refresh_from_db()
    assert not theirs.is_revoked


def test_a_tenant_member_cannot_list_or_create_staff_tokens(acme: Tenant) -> None:
    client = signed_in(user("acme-owner"))
    assert client.get("/api/v1/staff-tokens/").status_code == 403
    refused = client.post(
        "/api/v1/staff-tokens/",
        {"name": "x", "scope": "write", "expires_at": in_days(1)},
        format="json",
    )
    assert refused.status_code == 403
    assert not StaffToken.objects.exists()


def test_a_token_cannot_create_another_token(mint: Callable[..., str]) -> None:
    refused = curl(mint("write")).post(
        "/api/v1/staff-tokens/",
        {"name": "successor", "scope": "write", "expires_at": in_days(90)},
        content_type="application/json",
    )
    assert refused.status_code == 403
    assert refused.json() == {
        "detail": "Create staff tokens from a signed-in session, not a token."
    }
    assert StaffToken.objects.count() == 1


BAD_INPUT = [
    ({"expires_at": in_days(-1)}, "expires_at", "Must be in the future."),
    ({"expires_at": in_days(MAX_LIFETIME.days + 1)}, "expires_at", "At most 90 days from now."),
    ({"expires_at": None}, "expires_at", "This field may not be null."),
    ({"scope": "admin"}, "scope", '"admin" is not a valid choice.'),
    ({"name": ""}, "name", "This field may not be blank."),
    ({"name": "   "}, "name", "This field may not be blank."),
    ({"name": "x" * 101}, "name", "Ensure this field has no more than 100 characters."),
]


@pytest.mark.parametrize(("change", "field", "message"), BAD_INPUT)
def test_bad_input_is_a_400_naming_the_field_and_creates_nothing(
    ops: Any, change: dict[str, Any], field: str, message: str
) -> None:
    body = {"name": "ci", "scope": "write", "expires_at": in_days(30), **change}
    refused = signed_in(ops).post("/api/v1/staff-tokens/", body, format="json")
    assert refused.status_code == 400
    assert refused.json() == {field: [message]}
    assert not StaffToken.objects.exists()


def test_a_token_without_an_expiry_is_refused(ops: Any) -> None:
    body = {"name": "forever", "scope": "write"}
    refused = signed_in(ops).post("/api/v1/staff-tokens/", body, format="json")
    assert refused.status_code == 400
    assert refused.json() == {"expires_at": ["This field is required."]}
    assert not StaffToken.objects.exists()


# ------------------------------------------------------------------- using a token


def test_a_token_lists_tenants_and_deployments_with_only_the_authorization_header(
    acme: Tenant, globex: Tenant, mint: Callable[..., str]
) -> None:
    client = curl(mint("read"))
    tenants = client.get("/api/v1/tenants/")
    assert tenants.status_code == 200, tenants.json()
    assert [t["slug"] for t in tenants.json()["results"]] == ["acme", "globex"]
    assert client.get("/api/v1/deployments/").status_code == 200
    assert client.get("/api/v1/nodes/").status_code == 200  # staff only (IsAdminUser)


def test_a_write_token_creates_a_tenant_without_a_csrf_token(
    redis_client: Any, mint: Callable[..., str]
) -> None:
    created = curl(mint("write")).post(
        "/api/v1/tenants/", {"slug": "initech", "name": "Initech"}, content_type="application/json"
    )
    assert created.status_code == 201, created.json()
    assert Tenant.objects.filter(slug="initech").exists()


def test_a_read_token_is_refused_403_on_a_write_and_changes_nothing(
    redis_client: Any, mint: Callable[..., str]
) -> None:
    client = curl(mint("read"))
    refused = client.post(
        "/api/v1/tenants/", {"slug": "initech", "name": "Initech"}, content_type="application/json"
    )
    assert refused.status_code == 403
    assert refused.json() == {
        "detail": "This staff token has the read scope: GET, HEAD and OPTIONS only."
    }
    assert not Tenant.objects.filter(slug="initech").exists()
    assert client.delete("/api/v1/staff-tokens/1/").status_code == 403


def refused_401(raw_token: str, detail: str) -> None:
    response = curl(raw_token).get("/api/v1/tenants/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"
    assert response.json() == {"detail": detail}


def test_an_expired_token_is_401(mint: Callable[..., str]) -> None:
    raw = mint()
    StaffToken.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    refused_401(raw, "This staff token has expired.")


def test_a_revoked_token_is_401(ops: Any, mint: Callable[..., str]) -> None:
    raw = mint()
    assert curl(raw).get("/api/v1/tenants/").status_code == 200
    revoked = signed_in(ops).post(f"/api/v1/staff-tokens/{token_of(raw).pk}/revoke/")
    assert revoked.status_code == 200
    assert revoked.json()["revoked_at"] is not None
    refused_401(raw, "This staff token has been revoked.")


def test_a_token_whose_user_is_no_longer_staff_is_401(ops: Any, mint: Callable[..., str]) -> None:
    raw = mint()
    ops.is_staff = False
    ops.save(update_fields=["is_staff"])
    refused_401(raw, "This staff token's user is no longer active staff.")


def test_a_token_whose_user_is_deactivated_is_401(ops: Any, mint: Callable[..., str]) -> None:
    raw = mint()
    ops.is_active = False
    ops.save(update_fields=["is_active"])
    refused_401(raw, "This staff token's user is no longer active staff.")


def test_a_made_up_token_or_a_wrong_secret_is_401(mint: Callable[..., str]) -> None:
    raw = mint()
    wrong_secret = raw[:-4] + ("0000" if not raw.endswith("0000") else "1111")
    refused_401(wrong_secret, "Invalid staff token.")
    refused_401("pst_nothing", "Invalid staff token.")


def test_without_credentials_the_api_still_answers_403(db: None) -> None:
    response = Client().get("/api/v1/tenants/")
    assert response.status_code == 403
    assert response.json() == {"detail": "Authentication credentials were not provided."}


def test_a_tenants_api_key_still_acts_for_its_tenant_only(
    acme: Tenant, globex: Tenant, ops: Any
) -> None:
    _, raw_key = do_create_api_key(acme, "automation", user("acme-owner"), ["manage"])
    client = curl(raw_key)
    assert [t["slug"] for t in client.get("/api/v1/tenants/").json()["results"]] == ["acme"]
    assert client.get("/api/v1/nodes/").status_code == 403  # a key is never staff
    assert client.get("/api/v1/staff-tokens/").status_code == 403


def test_last_used_is_written_at_most_once_a_minute(mint: Callable[..., str]) -> None:
    raw = mint("read")
    client = curl(raw)

    def token_updates() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert client.get("/api/v1/staff-tokens/").status_code == 200
        return sum(
            q["sql"].startswith('UPDATE "tenants_stafftoken"') for q in queries.captured_queries
        )

    assert token_updates() == 1
    first_use = token_of(raw).last_used_at
    assert first_use is not None
    assert token_updates() == 0
    assert token_of(raw).last_used_at == first_use
    StaffToken.objects.update(last_used_at=timezone.now() - timedelta(minutes=2))
    assert token_updates() == 1


def test_revoking_with_the_action_twice_keeps_the_first_revocation(
    ops: Any, mint: Callable[..., str]
) -> None:
    token = token_of(mint())
    first = do_revoke_staff_token(token, ops).revoked_at
    assert do_revoke_staff_token(token, ops).revoked_at == first


# ------------------------------------------------------------------- never on /v1


@pytest.fixture
def asgi_server(transactional_db: None, redis_client: Any, monkeypatch: Any) -> Any:
    # Django runs each ASGI request's ORM calls on a thread of its own: a connection kept
    # open there would outlive the test and keep its database from being dropped.
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
    server = GatewayServer(free_port())
    server.start()
    yield server
    server.stop()


def test_a_token_works_on_api_through_asgi_but_never_on_the_gateway(asgi_server: Any) -> None:
    ops = get_user_model().objects.create_user("ops", is_staff=True)
    _, raw = do_create_staff_token(ops, "ci", "write", timezone.now() + timedelta(days=1))
    headers = {"Authorization": f"Bearer {raw}"}
    with httpx.Client(base_url=asgi_server.url, headers=headers, timeout=30) as http:
        assert http.get("/api/v1/tenants/").status_code == 200
        models = http.get("/v1/models")
        completion = http.post("/v1/chat/completions", json={"model": "x", "messages": []})
    assert models.status_code == 401
    assert models.json()["error"]["code"] == "invalid_api_key"
    assert completion.status_code == 401


# ------------------------------------------------------------------- the console page


def test_the_console_creates_a_token_and_shows_its_secret_once(ops: Any) -> None:
    client = Client()
    client.force_login(ops)
    created = client.post(
        "/console/tokens/create/", {"name": "nightly", "scope": "write", "lifetime_days": "7"}
    )
    assert created.status_code == 302
    assert created["Location"] == "/console/tokens/"
    token = StaffToken.objects.get()
    assert (token.name, token.scope) == ("nightly", "write")
    assert timedelta(days=6, hours=23) < token.expires_at - timezone.now() <= timedelta(days=7)

    page = client.get("/console/tokens/")
    secret = page.context["new_token"]["secret"]
    assert token.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret in page.content.decode()
    assert page["Cache-Control"] == "no-store"
    again = client.get("/console/tokens/")  # a refresh: the secret is gone, nothing minted
    assert secret not in again.content.decode()
    assert token.display in again.content.decode()
    assert StaffToken.objects.count() == 1


def test_the_console_revokes_a_token(ops: Any, mint: Callable[..., str]) -> None:
    token = token_of(mint())
    client = Client()
    client.force_login(ops)
    revoked = client.post(f"/console/tokens/{token.pk}/revoke/", follow=True)
    assert revoked.redirect_chain == [("/console/tokens/", 302)]
    assert f"Token automation ({token.display}) revoked." in revoked.content.decode()
    token.refresh_from_db()
    assert token.is_revoked


@pytest.mark.parametrize(
    ("form", "message"),
    [
        (
            {"name": "x", "scope": "write", "lifetime_days": "0"},
            "expires_at: Must be in the future.",
        ),
        ({"name": "x", "scope": "write", "lifetime_days": "91"}, "expires_at: At most 90 days"),
        ({"name": "x", "scope": "write", "lifetime_days": "soon"}, "enter a whole number of days"),
        ({"name": "x", "scope": "root", "lifetime_days": "7"}, "scope: Choose from read, write."),
        ({"name": " ", "scope": "read", "lifetime_days": "7"}, "name: Name the token"),
    ],
)
def test_the_console_refuses_bad_input_with_a_message_and_creates_nothing(
    ops: Any, form: dict[str, str], message: str
) -> None:
    client = Client()
    client.force_login(ops)
    page = client.post("/console/tokens/create/", form, follow=True)
    assert page.redirect_chain == [("/console/tokens/", 302)]
    assert message in page.content.decode()
    assert not StaffToken.objects.exists()


def test_the_console_page_is_for_staff_only(acme: Tenant) -> None:
    client = Client()
    client.force_login(user("acme-owner"))
    assert client.get("/console/tokens/").status_code == 403
    refused = client.post(
        "/console/tokens/create/", {"name": "x", "scope": "write", "lifetime_days": "7"}
    )
    assert refused.status_code == 403
    assert not StaffToken.objects.exists()
