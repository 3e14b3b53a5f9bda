"""The tenant portal in a real browser: keys by role, and a playground streaming through /v1."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from playwright.sync_api import Page, expect

from metering.ingest import Consumer
from metering.models import UsageEvent
from tenants.actions import do_create_tenant
from tenants.models import ApiKey, Membership, Role, Tenant
from tests.browser.conftest import log_in, make_user, screenshot
from tests.gateway.conftest import Fleet, GatewayServer, publish_catalog, wait_until
from tests.registry.conftest import make_model

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# Records every change of the reply's text with its time, from inside the page.
WATCH_REPLY = """() => {
  window.replyChanges = [];
  const output = document.getElementById('pg-output');
  new MutationObserver(() => window.replyChanges.push(
    {t: performance.now(), length: output.textContent.length})
  ).observe(output, {childList: true, characterData: true, subtree: true});
}"""


def member(tenant: Tenant, username: str, role: str) -> Any:
    user = make_user(username)
    Membership.objects.create(user=user, tenant=tenant, role=role)
    return user


@pytest.fixture
def acme(gpu_classes: None) -> Tenant:
    return do_create_tenant("acme", "Acme")


def test_a_developer_creates_a_key_streams_a_reply_and_sees_it_in_usage(
    gateway_server: GatewayServer, fleet: Fleet, acme: Tenant, redis_client: redis.Redis,
    page: Page,
) -> None:  # fmt: skip
    make_model("llama-3.1-8b")
    # Slow enough (time scale 1: real H100 speed) that tokens arrive over a few hundred ms.
    fleet.start(time_scale=1)
    fleet.publish()
    publish_catalog(redis_client)
    member(acme, "dev", Role.DEVELOPER)
    log_in(page, gateway_server.url, "dev")
    expect(page).to_have_url(f"{gateway_server.url}/portal/acme/")

    page.fill("input[name=name]", "backend")
    page.click("button:has-text('Create key')")
    secret = page.locator("#new-key-secret").inner_text().strip()
    key = ApiKey.objects.get(tenant=acme, name="backend")
    assert secret.startswith("sk-") and key.prefix in secret
    expect(page.locator("#keys")).to_contain_text("backend")
    screenshot(page, "portal-key-created")

    page.click("nav >> text=Playground")
    page.evaluate(WATCH_REPLY)
    page.fill("#pg-max-tokens", "40")
    page.click("#pg-send")
    expect(page.locator("#pg-output")).to_have_attribute("data-done", "true", timeout=30_000)
    changes = page.evaluate("window.replyChanges")
    lengths = [change["length"] for change in changes]
    assert len(changes) >= 5, changes
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    assert changes[-1]["t"] - changes[0]["t"] > 50, "the reply arrived all at once"
    request_id = page.locator("#pg-output").get_attribute("data-request-id")
    expect(page.locator("#pg-meta")).to_contain_text("completion tokens")
    screenshot(page, "portal-playground-streamed")
    minted = ApiKey.objects.get(tenant=acme, name="playground (dev)")
    assert minted.scopes == ["inference"] and minted.expires_at is not None

    consumer = Consumer(redis_client, "browser-test")
    assert wait_until(
        lambda: (
            consumer.drain(max_seconds=0.5).inserted > 0
            or UsageEvent.objects.filter(request_id=request_id).exists()
        ),
        timeout_s=15,
    )
    event = UsageEvent.objects.get(request_id=request_id)
    assert event.tenant_id == acme.pk and event.key_id == minted.pk

    page.click("nav >> text=Usage")
    row = page.locator("#recent-requests tbody tr").first
    expect(row).to_contain_text("llama-3.1-8b")
    expect(row).to_contain_text(request_id[:10])
    expect(row).to_contain_text(str(event.completion_tokens))
    expect(page.locator("#month-requests")).to_have_text("1")
    screenshot(page, "portal-usage-after-playground")


def test_a_viewer_cannot_create_a_key(
    gateway_server: GatewayServer, acme: Tenant, page: Page
) -> None:
    member(acme, "watcher", Role.VIEWER)
    log_in(page, gateway_server.url, "watcher")
    expect(page.locator("#no-create")).to_contain_text("viewer")
    expect(page.locator("#create-key-form")).to_have_count(0)

    # Past the missing form: a hand-made POST, with a valid CSRF token, is refused too.
    status = page.evaluate(
        """async () => {
          const token = JSON.parse(document.body.getAttribute('hx-headers'))['X-CSRFToken'];
          const body = new URLSearchParams({name: 'sneaky', scopes: 'inference',
                                            csrfmiddlewaretoken: token});
          const reply = await fetch('/portal/acme/keys/create/', {method: 'POST', body});
          return reply.status;
        }"""
    )
    assert status == 403
    assert not ApiKey.objects.filter(tenant=acme).exists()
    page.click("nav >> text=Playground")
    expect(page.locator("#pg-key")).to_have_attribute("placeholder", "sk-…")
    screenshot(page, "portal-viewer-keys")
