"""Bad input to the tenants' forms and APIs: refused with a message that says why, in the
caller's format (DRF's on /api, a message on the portal's form), never a 500, and nothing
changed in PostgreSQL or in the gateway's Redis records."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from django.utils import timezone

from serving.gateway.access import TIERS
from serving.router.contracts import DEFAULT_SLO_TIERS, TIER_RANK
from tenants.actions import (
    PLAYGROUND_KEY_MIN_LEFT,
    do_create_api_key,
    do_issue_playground_key,
    do_update_tenant,
)
from tenants.models import ApiKey, Membership, PriorityTier, Quota, Role, Tenant
from tests.tenants.conftest import user
from tests.tenants.test_api import client_for, run_on_commit, snapshot  # noqa: F401  (a fixture)

LONG_NAME = "k" * 100_000


def staff_client() -> Any:
    account = user("acme-viewer")
    account.is_staff = True
    account.save()
    return client_for("acme-viewer")


def portal_client(username: str) -> Client:
    client = Client()
    client.force_login(user(username))
    return client


# ---------------------------------------------------------------- priority tiers


def test_the_tenants_tiers_are_the_gateways_and_the_routers() -> None:
    assert set(PriorityTier.values) == set(TIERS) == set(TIER_RANK) == set(DEFAULT_SLO_TIERS)


@pytest.mark.usefixtures("run_on_commit")
def test_an_unknown_tier_in_a_quota_is_refused_and_changes_nothing(
    acme: Tenant, redis_client: Any
) -> None:
    client = staff_client()
    before = snapshot(redis_client)
    refused = client.patch("/api/v1/tenants/acme/quota/", {"allowed_tiers": ["vip"]}, format="json")
    assert refused.status_code == 400
    assert refused.json() == {
        "allowed_tiers": ["Unknown priority tier 'vip': choose from interactive, standard, batch."]
    }
    assert Quota.objects.get(tenant=acme).allowed_tiers == PriorityTier.values
    assert snapshot(redis_client) == before


@pytest.mark.usefixtures("run_on_commit")
def test_known_tiers_in_a_quota_are_saved(acme: Tenant) -> None:
    changed = staff_client().patch(
        "/api/v1/tenants/acme/quota/", {"allowed_tiers": ["batch"]}, format="json"
    )
    assert changed.status_code == 200 and changed.json()["allowed_tiers"] == ["batch"]


# ---------------------------------------------------------------- expiry


@pytest.mark.usefixtures("run_on_commit")
def test_a_key_expiring_in_the_past_is_refused_and_none_is_created(
    acme: Tenant, redis_client: Any
) -> None:
    before = snapshot(redis_client)
    refused = client_for("acme-dev").post(
        "/api/v1/tenants/acme/keys/",
        {"name": "old", "scopes": ["inference"], "expires_at": "2001-01-01T00:00:00Z"},
        format="json",
    )
    assert refused.status_code == 400
    assert refused.json() == {"expires_at": ["Choose a time in the future."]}
    assert not ApiKey.objects.exists()
    assert snapshot(redis_client) == before


@pytest.mark.usefixtures("run_on_commit")
def test_moving_a_keys_expiry_into_the_past_is_refused(acme: Tenant) -> None:
    key, _ = do_create_api_key(acme, "ci", user("acme-dev"), ["inference"])
    refused = client_for("acme-dev").patch(
        f"/api/v1/tenants/acme/keys/{key.pk}/", {"expires_at": "2001-01-01T00:00:00Z"}
    )
    assert refused.status_code == 400
    assert refused.json() == {"expires_at": ["Choose a time in the future."]}
    assert ApiKey.objects.get(pk=key.pk).expires_at is None


@pytest.mark.usefixtures("run_on_commit")
def test_a_key_expiring_tomorrow_is_created(acme: Tenant) -> None:
    tomorrow = (timezone.now() + timedelta(days=1)).isoformat()
    created = client_for("acme-dev").post(
        "/api/v1/tenants/acme/keys/",
        {"name": "ci", "scopes": ["inference"], "expires_at": tomorrow},
        format="json",
    )
    assert created.status_code == 201


# ---------------------------------------------------------------- lengths


@pytest.mark.parametrize(
    ("body", "refusal"),
    [
        ({"name": LONG_NAME}, {"name": ["Ensure this field has no more than 200 characters."]}),
        (
            {"model_allowlist": ["m" * 129]},
            {"model_allowlist": {"0": ["Ensure this field has no more than 128 characters."]}},
        ),
        (
            {"model_allowlist": ["m"] * 101},
            {"model_allowlist": ["Ensure this field has no more than 100 elements."]},
        ),
    ],
)
def test_a_too_long_value_for_a_key_is_a_400(
    acme: Tenant, redis_client: Any, body: dict[str, Any], refusal: dict[str, Any]
) -> None:
    before = snapshot(redis_client)
    refused = client_for("acme-dev").post(
        "/api/v1/tenants/acme/keys/", {"name": "ci", "scopes": ["inference"], **body}, format="json"
    )
    assert refused.status_code == 400 and refused.json() == refusal
    assert not ApiKey.objects.exists()
    assert snapshot(redis_client) == before


def test_a_too_long_tenant_name_is_a_400_and_the_name_stays(acme: Tenant) -> None:
    refused = staff_client().patch("/api/v1/tenants/acme/", {"name": LONG_NAME}, format="json")
    assert refused.status_code == 400
    assert refused.json() == {"name": ["Ensure this field has no more than 200 characters."]}
    assert Tenant.objects.get(pk=acme.pk).name == "Acme"


def test_the_action_refuses_a_too_long_tenant_name_too(acme: Tenant) -> None:
    with pytest.raises(ValidationError) as refusal:
        do_update_tenant(acme, name=LONG_NAME)
    assert refusal.value.message_dict == {"name": ["At most 200 characters (this one has 100000)."]}
    assert Tenant.objects.get(pk=acme.pk).name == "Acme"


def test_a_too_long_key_name_in_the_portal_is_a_message_on_the_form(acme: Tenant) -> None:
    dev = portal_client("acme-dev")
    reply = dev.post(
        "/portal/acme/keys/create/", {"name": LONG_NAME, "scopes": ["inference"]}, follow=True
    )
    assert reply.status_code == 200
    assert (
        "Key not created: name: At most 200 characters (this one has 100000)."
        in reply.content.decode()
    )
    assert not ApiKey.objects.exists()
    # what was typed comes back in the form, cut to what the field holds
    assert f'value="{"k" * 200}"' in reply.content.decode()


def test_an_empty_key_name_in_the_portal_is_a_message_on_the_form(acme: Tenant) -> None:
    reply = portal_client("acme-dev").post(
        "/portal/acme/keys/create/", {"name": "   "}, follow=True
    )
    assert "Key not created: name: Enter a name." in reply.content.decode()
    assert not ApiKey.objects.exists()


# ---------------------------------------------------------------- POST-redirect-GET


def test_creating_a_key_in_the_portal_redirects_and_shows_the_secret_once(acme: Tenant) -> None:
    dev = portal_client("acme-dev")
    created = dev.post("/portal/acme/keys/create/", {"name": "ci", "scopes": ["inference"]})
    assert created.status_code == 302 and created["Location"] == "/portal/acme/"
    shown = dev.get("/portal/acme/")
    secret = shown.context["new_key"]["secret"]
    key = ApiKey.objects.get(tenant=acme)
    assert secret.startswith(f"sk-{key.prefix}-") and secret.encode() in shown.content
    assert shown["Cache-Control"] == "no-store"
    reloaded = dev.get("/portal/acme/")
    assert secret.encode() not in reloaded.content
    assert ApiKey.objects.filter(tenant=acme).count() == 1


def test_the_secret_is_not_shown_in_another_tenants_portal(acme: Tenant, globex: Tenant) -> None:
    owner = user("acme-owner")
    Membership.objects.create(user=owner, tenant=globex, role=Role.OWNER)
    client = portal_client("acme-owner")
    client.post("/portal/acme/keys/create/", {"name": "ci", "scopes": ["inference"]})
    assert client.get("/portal/globex/").context["new_key"] is None


# ---------------------------------------------------------------- playground keys


def test_the_playground_hands_back_the_key_its_session_holds(acme: Tenant) -> None:
    dev = user("acme-dev")
    key, secret = do_issue_playground_key(acme, dev)
    again, same = do_issue_playground_key(acme, dev, secret)
    assert (again.pk, same) == (key.pk, secret)
    assert ApiKey.objects.filter(tenant=acme).count() == 1


def test_a_new_playground_key_revokes_the_members_older_one(acme: Tenant) -> None:
    dev = user("acme-dev")
    first, _ = do_issue_playground_key(acme, dev)
    second, _ = do_issue_playground_key(acme, dev)  # another browser: the secret is not held
    assert ApiKey.objects.get(pk=first.pk).is_revoked and not second.is_revoked
    assert ApiKey.objects.filter(tenant=acme, revoked_at__isnull=True).count() == 1


def test_a_playground_key_about_to_expire_is_replaced(acme: Tenant) -> None:
    dev = user("acme-dev")
    key, secret = do_issue_playground_key(acme, dev)
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() + PLAYGROUND_KEY_MIN_LEFT / 2)
    fresh, fresh_secret = do_issue_playground_key(acme, dev, secret)
    assert fresh.pk != key.pk and fresh_secret != secret


def test_another_members_playground_secret_is_not_handed_out(acme: Tenant) -> None:
    _, secret = do_issue_playground_key(acme, user("acme-admin"))
    mine, my_secret = do_issue_playground_key(acme, user("acme-dev"), secret)
    assert my_secret != secret and mine.created_by == user("acme-dev")
