"""Tenant administration in the console, in a real browser on a desktop and on a phone: create
a tenant, add a member and change their role, edit the quota, set a key's own limit; bad input
is refused with its message; no page scrolls sideways at 390 px."""

from __future__ import annotations

import pytest
import redis
from playwright.sync_api import Page, expect

from tenants.actions import do_create_api_key
from tenants.models import ApiKey, KeyQuotaOverride, Membership, Quota, Tenant
from tests.browser.conftest import assert_fits, log_in, make_user, screenshot
from tests.gateway.conftest import GatewayServer

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def people(gpu_classes: None, redis_client: redis.Redis) -> None:
    make_user("ops", is_staff=True)
    make_user("wile", email="wile@example.com")


@pytest.mark.parametrize("width", [1280, 390])
def test_staff_administer_a_tenant_from_the_console_and_each_page_fits_the_screen(
    gateway_server: GatewayServer, people: None, page: Page, width: int
) -> None:
    base = gateway_server.url
    slug = f"newco-{width}"
    page.set_viewport_size({"width": width, "height": 900})
    log_in(page, base, "ops")

    # a tenant, from the tenants list
    page.goto(f"{base}/console/tenants/")
    page.click("#new-tenant")
    expect(page).to_have_url(f"{base}/console/new-tenant/")
    assert_fits(page, "new tenant")
    page.fill("input[name=slug]", slug)
    page.fill("input[name=name]", "Newco " + "with a rather long name " * 3)
    page.fill("input[name=allowed_regions]", "us-east, eu-west")
    page.uncheck("input[name=allowed_tiers][value=batch]")
    page.click("button:has-text('Create tenant')")
    expect(page.locator(".messages")).to_contain_text(f"Tenant {slug} created.")
    expect(page).to_have_url(f"{base}/console/tenants/{slug}/settings/")
    assert_fits(page, "settings")
    tenant = Tenant.objects.get(slug=slug)
    assert tenant.allowed_regions == ["us-east", "eu-west"]
    assert Quota.objects.get(tenant=tenant).allowed_tiers == ["interactive", "standard"]

    # a taken slug is refused, what was typed comes back
    page.goto(f"{base}/console/new-tenant/")
    page.fill("input[name=slug]", slug)
    page.fill("input[name=name]", "Again")
    page.click("button:has-text('Create tenant')")
    expect(page.locator(".messages")).to_contain_text(
        "Tenant not created: slug: A tenant with this slug already exists."
    )
    expect(page.locator("input[name=name]")).to_have_value("Again")
    assert Tenant.objects.filter(slug=slug).count() == 1

    # a member: an unknown user is refused, a known one added, then their role changed
    page.goto(f"{base}/console/tenants/{slug}/members/")
    page.fill("input[name=user]", "nobody@example.com")
    page.click("button:has-text('Add member')")
    expect(page.locator(".messages")).to_contain_text(
        "Member not added: user: No active user has this username or email."
    )
    assert not Membership.objects.filter(tenant=tenant).exists()
    page.fill("input[name=user]", "wile@example.com")
    page.select_option("#add-member-form select[name=role]", "developer")
    page.click("button:has-text('Add member')")
    expect(page.locator("#member-wile")).to_contain_text("wile@example.com")
    page.select_option("#member-wile select[name=role]", "admin")
    page.click("#member-wile button:has-text('Change role')")
    expect(page.locator(".messages")).to_contain_text(f"wile is now admin of {slug}.")
    assert Membership.objects.get(tenant=tenant, user__username="wile").role == "admin"
    assert_fits(page, "members")

    # the quota: a negative value the page's min would stop is refused by the server too
    page.goto(f"{base}/console/tenants/{slug}/")
    page.click("#edit-quota")
    page.evaluate(
        "document.querySelector('input[name=requests_per_minute]').removeAttribute('min')"
    )
    page.fill("input[name=requests_per_minute]", "-5")
    page.click("button:has-text('Save quota')")
    expect(page.locator(".messages")).to_contain_text(
        "Quota not saved: requests per minute: Ensure this value is greater than or equal to 0."
    )
    expect(page.locator("input[name=requests_per_minute]")).to_have_attribute(
        "aria-invalid", "true"
    )
    assert Quota.objects.get(tenant=tenant).requests_per_minute == 600
    page.fill("input[name=requests_per_minute]", "120")
    page.click("button:has-text('Save quota')")
    expect(page.locator(".messages")).to_contain_text(f"Quota of {slug} saved.")
    assert Quota.objects.get(tenant=tenant).requests_per_minute == 120
    assert_fits(page, "quota")

    # a key's own limit, reached from the tenant's page
    key, _ = do_create_api_key(tenant, "backend", None, ["inference"])
    page.goto(f"{base}/console/tenants/{slug}/")
    page.click("a:has-text('backend')")
    page.fill("#key-limits-form input[name=requests_per_minute]", "10")
    page.click("button:has-text('Save key limits')")
    expect(page.locator(".messages")).to_contain_text("Limits of key backend saved.")
    assert KeyQuotaOverride.objects.get(api_key=key).requests_per_minute == 10
    page.fill("#key-edit-form input[name=expires_at]", "2001-01-01T00:00")
    page.click("#key-edit-form button[type=submit]")
    expect(page.locator(".messages")).to_contain_text(
        "Key not saved: expires at: Choose a time in the future."
    )
    assert ApiKey.objects.get(pk=key.pk).expires_at is None
    assert_fits(page, "key")
    screenshot(page, f"console-tenant-key-{width}")

    page.once("dialog", lambda dialog: dialog.accept())
    page.click("button:has-text('Revoke key')")
    expect(page.locator("#key-status")).to_have_text("revoked")
    assert ApiKey.objects.get(pk=key.pk).is_revoked

    page.goto(f"{base}/console/tenants/{slug}/")
    assert_fits(page, "tenant")
    page.goto(f"{base}/console/tenants/")
    assert_fits(page, "tenants")
