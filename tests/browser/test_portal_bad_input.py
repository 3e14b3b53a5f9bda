"""The portal's key form in a real browser, on a desktop and on a phone: a refresh after
creating a key creates no second one, and a name too long is refused with a message."""

from __future__ import annotations

import pytest
from playwright.sync_api import Browser, expect

from tenants.actions import do_create_tenant
from tenants.models import ApiKey, Membership, Role, Tenant
from tests.browser.conftest import assert_fits, log_in, make_user, screenshot
from tests.gateway.conftest import GatewayServer

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def acme(gpu_classes: None) -> Tenant:
    tenant = do_create_tenant("acme", "Acme")
    Membership.objects.create(user=make_user("dev"), tenant=tenant, role=Role.DEVELOPER)
    return tenant


def test_a_key_is_created_once_and_a_too_long_name_is_refused_at_1280_and_390_px(
    gateway_server: GatewayServer, acme: Tenant, browser: Browser
) -> None:
    for width in (1280, 390):
        context = browser.new_context(viewport={"width": width, "height": 900})
        page = context.new_page()
        page.set_default_timeout(15_000)
        log_in(page, gateway_server.url, "dev")
        name = f"backend {width}"

        page.fill("input[name=name]", name)
        page.click("button:has-text('Create key')")
        expect(page).to_have_url(f"{gateway_server.url}/portal/acme/")
        expect(page.locator("#new-key-secret")).to_contain_text("sk-")
        page.reload()
        expect(page.locator("#new-key")).to_have_count(0)
        expect(page.locator("#keys")).to_contain_text(name)
        assert ApiKey.objects.filter(tenant=acme, name=name).count() == 1

        # The page's maxlength stops a person typing more; a client that ignores it is refused
        # by the server all the same.
        page.evaluate("document.querySelector('input[name=name]').removeAttribute('maxlength')")
        page.fill("input[name=name]", "k" * 5000)
        page.click("button:has-text('Create key')")
        expect(page.locator(".messages")).to_contain_text(
            "Key not created: name: At most 200 characters (this one has 5000)."
        )
        assert ApiKey.objects.filter(tenant=acme).count() == (1 if width == 1280 else 2)
        assert_fits(page, f"new key at {width} px")
        screenshot(page, f"portal-key-name-too-long-{width}")
        context.close()
