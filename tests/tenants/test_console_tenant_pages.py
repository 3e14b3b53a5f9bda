"""The console's tenant administration pages through Django's test client: each form changes
what the REST API then shows; each bad input is refused with a message on the page and changes
nothing in PostgreSQL or in the gateway's Redis records; only staff get in."""

from __future__ import annotations

import html
import json
from datetime import UTC, timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from tenants.actions import do_create_api_key
from tenants.keys import key_record_name
from tenants.models import ApiKey, KeyQuotaOverride, Membership, Quota, Role, Tenant
from tests.tenants.conftest import user
from tests.tenants.test_api import client_for as api_client_for
from tests.tenants.test_api import snapshot

LONG_NAME = "n" * 100_000


class CommittingClient(Client):
    """A test client whose POSTs run their on-commit callbacks (the Redis records and events)
    before answering, as a real request's transaction would, so a test sees what Redis got."""

    def __init__(self, capture: Any) -> None:
        super().__init__()
        self.capture = capture

    def post(self, *args: Any, **kwargs: Any) -> Any:
        with self.capture(execute=True):
            return super().post(*args, **kwargs)


@pytest.fixture
def committing(django_capture_on_commit_callbacks: Any) -> Any:
    def client_for(account: Any) -> CommittingClient:
        client = CommittingClient(django_capture_on_commit_callbacks)
        client.force_login(account)
        return client

    return client_for


@pytest.fixture
def ops(db: None) -> Any:
    return get_user_model().objects.create_user("ops", email="ops@example.com", is_staff=True)


@pytest.fixture
def staff(ops: Any, committing: Any) -> Client:
    client: Client = committing(ops)
    return client


@pytest.fixture
def key(acme: Tenant, django_capture_on_commit_callbacks: Any) -> ApiKey:
    with django_capture_on_commit_callbacks(execute=True):
        created, _ = do_create_api_key(acme, "backend", user("acme-dev"), ["inference"])
    return created


def record_of(redis_client: Any, key: ApiKey) -> Any:
    """The gateway's Redis record of `key`."""
    return json.loads(redis_client.get(key_record_name(key.secret_hash)))


def page_text(reply: Any) -> str:
    assert reply.status_code == 200, reply.status_code
    return html.unescape(reply.content.decode())


def api(path: str) -> Any:
    """What the REST API shows staff at `path`."""
    account = get_user_model().objects.get(username="ops")
    client = Client()
    client.force_login(account)
    reply = client.get(f"/api/v1/{path}")
    return reply.json() if reply.status_code == 200 else reply.status_code


# ---------------------------------------------------------------- only staff


def _routes(acme: Tenant, key: ApiKey) -> list[tuple[str, str]]:
    member = Membership.objects.get(user__username="acme-viewer")
    base = "/console/tenants/acme"
    return [
        ("get", "/console/new-tenant/"),
        ("post", "/console/new-tenant/"),
        ("get", f"{base}/settings/"),
        ("post", f"{base}/settings/"),
        ("post", f"{base}/status/"),
        ("post", f"{base}/delete/"),
        ("get", f"{base}/members/"),
        ("post", f"{base}/members/add/"),
        ("post", f"{base}/members/{member.pk}/role/"),
        ("post", f"{base}/members/{member.pk}/remove/"),
        ("get", f"{base}/quota/"),
        ("post", f"{base}/quota/"),
        ("get", f"{base}/keys/{key.pk}/"),
        ("post", f"{base}/keys/{key.pk}/limits/"),
        ("post", f"{base}/keys/{key.pk}/edit/"),
        ("post", f"{base}/keys/{key.pk}/revoke/"),
    ]


def test_the_tenants_owner_is_refused_every_page_and_form_and_nothing_changes(
    acme: Tenant, key: ApiKey, redis_client: Any, committing: Any
) -> None:
    owner = committing(user("acme-owner"))
    before = snapshot(redis_client)
    post = {"slug": "newco", "name": "Newco", "role": "owner", "status": "suspended"}
    for method, path in _routes(acme, key):
        reply = (
            owner.post(path, {**post, "confirm": "acme"}) if method == "post" else owner.get(path)
        )
        assert reply.status_code == 403, (method, path)
    assert snapshot(redis_client) == before


def test_an_anonymous_visitor_is_sent_to_the_login_page(acme: Tenant, key: ApiKey) -> None:
    for method, path in _routes(acme, key):
        reply = getattr(Client(), method)(path)
        assert reply.status_code == 302 and reply["Location"].startswith("/login/"), path


def test_every_page_renders_for_staff(staff: Client, acme: Tenant, key: ApiKey) -> None:
    for method, path in _routes(acme, key):
        if method == "get":
            assert staff.get(path).status_code == 200, path


def test_the_tenant_pages_link_to_the_forms(staff: Client, acme: Tenant, key: ApiKey) -> None:
    listing = page_text(staff.get("/console/tenants/"))
    assert 'href="/console/new-tenant/"' in listing
    detail = page_text(staff.get("/console/tenants/acme/"))
    for path in ("settings/", "members/", "quota/", f"keys/{key.pk}/"):
        assert f'href="/console/tenants/acme/{path}"' in detail


# ---------------------------------------------------------------- tenants


def test_staff_create_a_tenant_and_the_api_shows_it(staff: Client, db: None) -> None:
    reply = staff.post(
        "/console/new-tenant/",
        {
            "slug": "newco",
            "name": "Newco Ltd",
            "allowed_regions": "us-east, eu-west",
            "allowed_tiers": ["standard", "batch"],
            "fail_open": "on",
        },
    )
    assert reply.status_code == 302 and reply["Location"] == "/console/tenants/newco/settings/"
    shown = api("tenants/newco/")
    assert (shown["name"], shown["allowed_regions"], shown["fail_open"]) == (
        "Newco Ltd",
        ["us-east", "eu-west"],
        True,
    )
    assert api("tenants/newco/quota/")["allowed_tiers"] == ["standard", "batch"]
    assert "Tenant newco created." in page_text(staff.get(reply["Location"]))


@pytest.mark.parametrize(
    ("form", "message"),
    [
        (
            {"allowed_tiers": ["vip"]},
            "Tenant not created: allowed tiers: Unknown priority tier 'vip': "
            "choose from interactive, standard, batch.",
        ),
        ({"name": LONG_NAME}, "Tenant not created: name: At most 200 characters (this one has"),
        ({"name": "   "}, "Tenant not created: name: Enter a name."),
        ({"slug": "acme"}, "Tenant not created: slug: A tenant with this slug already exists."),
        ({"slug": "new co!"}, "slug: Use only letters, digits, hyphens and underscores."),
        ({"slug": "s" * 65}, "slug: At most 64 characters (this one has 65)."),
        (
            {"allowed_regions": "r" * 65},
            "allowed regions: A region name has at most 64 characters.",
        ),
    ],
)
def test_a_bad_new_tenant_is_refused_with_a_message_and_nothing_is_created(
    staff: Client, acme: Tenant, redis_client: Any, form: dict[str, Any], message: str
) -> None:
    before = snapshot(redis_client)
    body = {"slug": "newco", "name": "Newco", "allowed_tiers": ["standard"], **form}
    reply = staff.post("/console/new-tenant/", body, follow=True)
    assert message in page_text(reply)
    assert snapshot(redis_client) == before
    assert list(Tenant.objects.values_list("slug", flat=True)) == ["acme"]


def test_a_refused_new_tenant_form_keeps_what_was_typed(staff: Client, acme: Tenant) -> None:
    reply = staff.post(
        "/console/new-tenant/",
        {"slug": "newco", "name": LONG_NAME, "allowed_regions": "us-east"},
        follow=True,
    )
    text = page_text(reply)
    assert 'value="newco"' in text and 'value="us-east"' in text
    assert f'value="{"n" * 200}"' in text  # cut to what the field holds
    # shown once: the next visit is a fresh form
    assert 'value="newco"' not in page_text(staff.get("/console/new-tenant/"))


def test_staff_change_a_tenants_settings_and_the_api_shows_them(
    staff: Client, acme: Tenant
) -> None:
    reply = staff.post(
        "/console/tenants/acme/settings/",
        {"name": "Acme Corp", "allowed_regions": "eu-west", "blocked_patterns": "secret\\d+\n"},
    )
    assert reply.status_code == 302
    shown = api("tenants/acme/")
    assert shown["name"] == "Acme Corp" and shown["allowed_regions"] == ["eu-west"]
    assert shown["blocked_patterns"] == ["secret\\d+"] and shown["fail_open"] is False


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"name": LONG_NAME}, "Settings not saved: name: At most 200 characters"),
        ({"name": ""}, "Settings not saved: name: Enter a name."),
        ({"blocked_patterns": "(unclosed"}, "Settings not saved: blocked patterns:"),
        (
            {"blocked_patterns": "p" * 501},
            "blocked patterns: A pattern has at most 500 characters.",
        ),
    ],
)
def test_bad_settings_are_refused_with_a_message_and_change_nothing(
    staff: Client, acme: Tenant, redis_client: Any, form: dict[str, Any], message: str
) -> None:
    before = snapshot(redis_client)
    reply = staff.post("/console/tenants/acme/settings/", {"name": "Acme", **form}, follow=True)
    assert message in page_text(reply)
    assert snapshot(redis_client) == before


def test_staff_suspend_a_tenant_and_its_keys_record_says_so(
    staff: Client, acme: Tenant, key: ApiKey, redis_client: Any
) -> None:
    staff.post("/console/tenants/acme/status/", {"status": "suspended"})
    assert api("tenants/acme/")["status"] == "suspended"
    assert record_of(redis_client, key)["principal"]["tenant_status"] == "suspended"
    staff.post("/console/tenants/acme/status/", {"status": "active"})
    assert api("tenants/acme/")["status"] == "active"


def test_an_unknown_status_is_refused(staff: Client, acme: Tenant, redis_client: Any) -> None:
    before = snapshot(redis_client)
    reply = staff.post("/console/tenants/acme/status/", {"status": "blocked"}, follow=True)
    assert "Status not changed: status: Choose from active, suspended" in page_text(reply)
    assert snapshot(redis_client) == before


def test_deleting_needs_the_slug_typed_and_then_deletes_the_tenant_and_its_keys(
    staff: Client, acme: Tenant, key: ApiKey, redis_client: Any
) -> None:
    before = snapshot(redis_client)
    refused = staff.post("/console/tenants/acme/delete/", {"confirm": "acm"}, follow=True)
    assert "Tenant not deleted: confirm: Type the slug, acme, to delete." in page_text(refused)
    assert snapshot(redis_client) == before
    deleted = staff.post("/console/tenants/acme/delete/", {"confirm": "acme"})
    assert deleted.status_code == 302 and deleted["Location"] == "/console/tenants/"
    assert api("tenants/acme/") == 404
    assert not ApiKey.objects.exists()


# ---------------------------------------------------------------- members


def test_staff_add_a_member_by_username_or_email_and_the_api_lists_them(
    staff: Client, acme: Tenant
) -> None:
    get_user_model().objects.create_user("wile", email="Wile@Example.com")
    get_user_model().objects.create_user("road")
    staff.post("/console/tenants/acme/members/add/", {"user": "road", "role": "developer"})
    staff.post("/console/tenants/acme/members/add/", {"user": "wile@example.com", "role": "admin"})
    listed = {row["username"]: row["role"] for row in api("tenants/acme/members/")["results"]}
    assert (listed["road"], listed["wile"]) == ("developer", "admin")


def test_staff_change_a_members_role_and_remove_them(staff: Client, acme: Tenant) -> None:
    viewer = Membership.objects.get(user__username="acme-viewer")
    reply = staff.post(
        f"/console/tenants/acme/members/{viewer.pk}/role/", {"role": "admin"}, follow=True
    )
    assert "acme-viewer is now admin of acme." in page_text(reply)
    assert api(f"tenants/acme/members/{viewer.pk}/")["role"] == "admin"
    staff.post(f"/console/tenants/acme/members/{viewer.pk}/remove/")
    assert api(f"tenants/acme/members/{viewer.pk}/") == 404


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"user": "nobody"}, "Member not added: user: No active user has this username or email."),
        ({"user": "nobody@example.com"}, "user: No active user has this username or email."),
        ({"user": "acme-dev"}, "Member not added: user: Already a member of this tenant."),
        ({"role": "god"}, "Member not added: role: Choose from owner, admin, developer, viewer"),
        ({"user": "u" * 100_000}, "user: No active user has this username or email."),
    ],
)
def test_a_bad_member_is_refused_with_a_message_and_nothing_changes(
    staff: Client, acme: Tenant, redis_client: Any, form: dict[str, Any], message: str
) -> None:
    before = snapshot(redis_client)
    body = {"user": "ops", "role": "viewer", **form}
    reply = staff.post("/console/tenants/acme/members/add/", body, follow=True)
    assert message in page_text(reply)
    assert snapshot(redis_client) == before


def test_an_inactive_user_is_not_added(staff: Client, acme: Tenant) -> None:
    get_user_model().objects.create_user("gone", is_active=False)
    reply = staff.post("/console/tenants/acme/members/add/", {"user": "gone", "role": "viewer"})
    assert reply.status_code == 302
    assert not Membership.objects.filter(user__username="gone").exists()


def test_the_last_owner_keeps_the_owner_role(
    staff: Client, acme: Tenant, redis_client: Any
) -> None:
    owner = Membership.objects.get(user__username="acme-owner")
    before = snapshot(redis_client)
    demoted = staff.post(
        f"/console/tenants/acme/members/{owner.pk}/role/", {"role": "viewer"}, follow=True
    )
    assert "Role of acme-owner not changed: role: A tenant keeps at least one owner." in (
        page_text(demoted)
    )
    removed = staff.post(f"/console/tenants/acme/members/{owner.pk}/remove/", follow=True)
    assert "acme-owner not removed: role: A tenant keeps at least one owner." in page_text(removed)
    unknown = staff.post(
        f"/console/tenants/acme/members/{owner.pk}/role/", {"role": "god"}, follow=True
    )
    assert "role: Choose from owner, admin, developer, viewer" in page_text(unknown)
    assert snapshot(redis_client) == before


def test_another_tenants_member_is_a_404_here(staff: Client, acme: Tenant, globex: Tenant) -> None:
    theirs = Membership.objects.get(user__username="globex-viewer")
    reply = staff.post(f"/console/tenants/acme/members/{theirs.pk}/role/", {"role": "admin"})
    assert reply.status_code == 404
    assert Membership.objects.get(pk=theirs.pk).role == Role.VIEWER


# ---------------------------------------------------------------- quota

QUOTA_FORM = {
    "requests_per_minute": "120",
    "tokens_per_minute": "50000",
    "concurrent_streams": "4",
    "max_tokens_cap": "2048",
    "max_context_tokens": "8192",
    "monthly_token_budget": "",
    "monthly_spend_budget_usd": "250.50",
    "soft_alert_fraction": "0.9",
    "allowed_tiers": ["interactive", "standard"],
}


def test_staff_edit_the_quota_and_the_api_and_the_keys_record_show_it(
    staff: Client, acme: Tenant, key: ApiKey, redis_client: Any
) -> None:
    reply = staff.post("/console/tenants/acme/quota/", QUOTA_FORM, follow=True)
    assert "Quota of acme saved." in page_text(reply)
    shown = api("tenants/acme/quota/")
    assert shown == {
        "requests_per_minute": 120,
        "tokens_per_minute": 50000,
        "concurrent_streams": 4,
        "max_tokens_cap": 2048,
        "max_context_tokens": 8192,
        "monthly_token_budget": None,
        "monthly_spend_budget_usd": "250.50",
        "soft_alert_fraction": 0.9,
        "hard_budget": False,
        "allowed_tiers": ["interactive", "standard"],
    }
    limits = record_of(redis_client, key)["principal"]["limits"]
    assert limits["tenant_requests_per_minute"] == 120


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"requests_per_minute": "-5"}, "requests per minute: Ensure this value is greater than"),
        (
            {"tokens_per_minute": "lots"},
            "Quota not saved: tokens per minute: Enter a whole number.",
        ),
        ({"concurrent_streams": ""}, "concurrent streams: Enter a whole number."),
        ({"max_tokens_cap": "9" * 20}, "max tokens cap: Ensure this value is less than"),
        ({"monthly_spend_budget_usd": "-1"}, "monthly spend budget usd: Ensure this value is"),
        ({"monthly_spend_budget_usd": "NaN"}, "monthly spend budget usd: Enter an amount"),
        ({"soft_alert_fraction": "2"}, "soft alert fraction: Ensure this value is less than"),
        ({"soft_alert_fraction": "nan"}, "soft alert fraction: Enter a number from 0 to 1."),
        ({"allowed_tiers": ["vip"]}, "allowed tiers: Unknown priority tier 'vip'"),
    ],
)
def test_a_bad_quota_is_refused_with_a_message_and_changes_nothing(
    staff: Client, acme: Tenant, key: ApiKey, redis_client: Any, form: dict[str, Any], message: str
) -> None:
    before = snapshot(redis_client)
    reply = staff.post("/console/tenants/acme/quota/", {**QUOTA_FORM, **form}, follow=True)
    text = page_text(reply)
    assert message in text and "Quota not saved:" in text
    assert snapshot(redis_client) == before
    assert Quota.objects.get(tenant=acme).requests_per_minute == 600


def test_a_refused_quota_form_keeps_what_was_typed_and_marks_the_field(
    staff: Client, acme: Tenant
) -> None:
    form = {**QUOTA_FORM, "requests_per_minute": "-5"}
    text = page_text(staff.post("/console/tenants/acme/quota/", form, follow=True))
    assert (
        'name="requests_per_minute" min="0" step="1" required value="-5" aria-invalid="true"'
        in (text)
    )
    assert 'value="50000"' in text


# ---------------------------------------------------------------- one key


def test_staff_set_a_keys_own_limits_and_the_api_shows_them(
    staff: Client, acme: Tenant, key: ApiKey, redis_client: Any
) -> None:
    reply = staff.post(
        f"/console/tenants/acme/keys/{key.pk}/limits/",
        {"requests_per_minute": "10", "concurrent_streams": "1", "tokens_per_minute": ""},
        follow=True,
    )
    assert "Limits of key backend saved." in page_text(reply)
    shown = api(f"tenants/acme/keys/{key.pk}/limits/")
    assert shown == {
        "requests_per_minute": 10,
        "tokens_per_minute": None,
        "concurrent_streams": 1,
        "max_tokens_cap": None,
        "max_context_tokens": None,
    }
    limits = record_of(redis_client, key)["principal"]["limits"]
    assert (limits["requests_per_minute"], limits["tenant_requests_per_minute"]) == (10, 600)


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"requests_per_minute": "-1"}, "requests per minute: Ensure this value is greater than"),
        ({"tokens_per_minute": "ten"}, "Key limits not saved: tokens per minute: Enter a whole"),
        ({"concurrent_streams": "9" * 30}, "concurrent streams: Ensure this value is less than"),
    ],
)
def test_bad_key_limits_are_refused_with_a_message_and_change_nothing(
    staff: Client, acme: Tenant, key: ApiKey, redis_client: Any, form: dict[str, Any], message: str
) -> None:
    before = snapshot(redis_client)
    reply = staff.post(f"/console/tenants/acme/keys/{key.pk}/limits/", form, follow=True)
    assert message in page_text(reply)
    assert snapshot(redis_client) == before
    assert not KeyQuotaOverride.objects.exists()


def test_the_action_refuses_a_negative_key_limit_for_the_api_too(acme: Tenant, key: ApiKey) -> None:
    refused = api_client_for("acme-admin").patch(
        f"/api/v1/tenants/acme/keys/{key.pk}/limits/", {"requests_per_minute": -1}, format="json"
    )
    assert refused.status_code == 400


def test_staff_rename_a_key_and_set_its_expiry(staff: Client, acme: Tenant, key: ApiKey) -> None:
    tomorrow = timezone.localtime() + timedelta(days=1)
    staff.post(
        f"/console/tenants/acme/keys/{key.pk}/edit/",
        {"name": "backend prod", "expires_at": tomorrow.strftime("%Y-%m-%dT%H:%M")},
    )
    shown = api(f"tenants/acme/keys/{key.pk}/")
    assert shown["name"] == "backend prod"
    assert shown["expires_at"].startswith(tomorrow.astimezone(UTC).strftime("%Y-%m-%dT"))


@pytest.mark.parametrize(
    ("form", "message"),
    [
        (
            {"expires_at": "2001-01-01T00:00"},
            "Key not saved: expires at: Choose a time in the future.",
        ),
        ({"expires_at": "next week"}, "expires at: Enter a date and time"),
        ({"expires_at": "2030-02-31T10:00"}, "expires at: Enter a date and time"),
        ({"name": LONG_NAME}, "Key not saved: name: At most 200 characters"),
    ],
)
def test_a_bad_key_edit_is_refused_with_a_message_and_changes_nothing(
    staff: Client, acme: Tenant, key: ApiKey, redis_client: Any, form: dict[str, Any], message: str
) -> None:
    before = snapshot(redis_client)
    body = {"name": "backend", "expires_at": "", **form}
    reply = staff.post(f"/console/tenants/acme/keys/{key.pk}/edit/", body, follow=True)
    assert message in page_text(reply)
    assert snapshot(redis_client) == before


def test_an_expired_key_can_still_be_renamed(staff: Client, acme: Tenant, key: ApiKey) -> None:
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(days=1))
    form = staff.get(f"/console/tenants/acme/keys/{key.pk}/").context["key_form"]["values"]
    staff.post(f"/console/tenants/acme/keys/{key.pk}/edit/", {**form, "name": "old backend"})
    assert ApiKey.objects.get(pk=key.pk).name == "old backend"


def test_staff_revoke_a_key_and_its_record_becomes_a_tombstone(
    staff: Client, acme: Tenant, key: ApiKey, redis_client: Any
) -> None:
    reply = staff.post(f"/console/tenants/acme/keys/{key.pk}/revoke/", follow=True)
    assert "Key backend" in page_text(reply) and "revoked." in page_text(reply)
    assert api(f"tenants/acme/keys/{key.pk}/")["revoked_at"] is not None
    assert record_of(redis_client, key)["revoked"] is True


def test_another_tenants_key_is_a_404_here(
    staff: Client, acme: Tenant, globex: Tenant, redis_client: Any
) -> None:
    theirs, _ = do_create_api_key(globex, "theirs", user("globex-dev"), ["inference"])
    assert staff.post(f"/console/tenants/acme/keys/{theirs.pk}/revoke/").status_code == 404
    assert staff.get(f"/console/tenants/acme/keys/{theirs.pk}/").status_code == 404
    assert not ApiKey.objects.get(pk=theirs.pk).is_revoked
