"""The tenant portal in a real browser: keys by role, a playground streaming through /v1, and
usage charts whose axis labels fit at common widths."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.utils import timezone
from playwright.sync_api import Page, expect

from metering.ingest import Consumer
from metering.models import UsageEvent
from tenants.actions import do_create_tenant
from tenants.models import ApiKey, Membership, Quota, Role, Tenant
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

# Records the box of every text drawn on a canvas (uPlot draws its axis labels there), in the
# canvas's pixels after its transform (axis titles are rotated).
WATCH_CANVAS_TEXT = """
window.canvasTexts = [];
const fillText = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
  const m = this.measureText(text);
  const t = this.getTransform();
  const corners = [
    [x - m.actualBoundingBoxLeft, y - m.actualBoundingBoxAscent],
    [x + m.actualBoundingBoxRight, y - m.actualBoundingBoxAscent],
    [x - m.actualBoundingBoxLeft, y + m.actualBoundingBoxDescent],
    [x + m.actualBoundingBoxRight, y + m.actualBoundingBoxDescent],
  ].map(([px, py]) => t.transformPoint(new DOMPoint(px, py)));
  window.canvasTexts.push({
    canvas: this.canvas, text: String(text),
    left: Math.min(...corners.map((c) => c.x)), right: Math.max(...corners.map((c) => c.x)),
    top: Math.min(...corners.map((c) => c.y)), bottom: Math.max(...corners.map((c) => c.y)),
  });
  return fillText.call(this, text, x, y, ...rest);
};
"""

# The texts drawn in each chart's canvas, with their boxes in page pixels, and the chart's box.
CHART_TEXTS = """(id) => {
  const chart = document.getElementById(id);
  const canvas = chart.querySelector('canvas');
  const rect = canvas.getBoundingClientRect();
  const scale = rect.width / canvas.width;
  const box = chart.getBoundingClientRect();
  const latest = new Map();  // a redraw paints the same label again: keep the last paint
  for (const t of window.canvasTexts.filter((t) => t.canvas === canvas)) {
    latest.set(t.text + '@' + Math.round(t.top), t);
  }
  return {
    chart: {left: box.left, right: box.right, top: box.top, bottom: box.bottom},
    texts: [...latest.values()].map((t) => ({
      text: t.text,
      left: rect.left + t.left * scale, right: rect.left + t.right * scale,
      top: rect.top + t.top * scale, bottom: rect.top + t.bottom * scale,
    })),
  };
}"""


def member(tenant: Tenant, username: str, role: str) -> Any:
    user = make_user(username)
    Membership.objects.create(user=user, tenant=tenant, role=role)
    return user


@pytest.fixture
def acme(gpu_classes: None) -> Tenant:
    return do_create_tenant("acme", "Acme")


def test_a_developer_creates_a_key_streams_a_reply_and_sees_it_in_usage(
    gateway_server: GatewayServer,
    fleet: Fleet,
    acme: Tenant,
    redis_client: redis.Redis,
    page: Page,
) -> None:
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
    assert request_id is not None
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


def usage_day(tenant: Tenant, days_ago: int, tokens: int, price_usd: float) -> None:
    started = timezone.now() - timedelta(days=days_ago)
    UsageEvent.objects.create(
        request_id=f"req-{tenant.slug}-{days_ago}",
        tenant_id=tenant.pk,
        model="llama-3.1-8b",
        priority="standard",
        prompt_tokens=tokens // 2,
        cached_prompt_tokens=0,
        completion_tokens=tokens - tokens // 2,
        status="ok",
        queue_ms=1.0,
        total_ms=900.0,
        price_charged_usd_micros=round(price_usd * 1e6),
        started_at=started,
        ended_at=started,
    )


@pytest.mark.parametrize("width", [1280, 768, 390])
def test_the_usage_charts_axis_labels_are_whole_and_compact(
    gateway_server: GatewayServer, acme: Tenant, page: Page, width: int
) -> None:
    # Large figures: tens of millions of tokens a day, thousands of dollars against a budget.
    for days_ago, tokens in [(0, 48_500_000), (1, 12_300_000), (3, 91_000_000)]:
        usage_day(acme, days_ago, tokens, price_usd=tokens / 10_000)
    Quota.objects.filter(tenant=acme).update(monthly_spend_budget_usd=25_000)
    member(acme, "analyst", Role.VIEWER)
    page.set_viewport_size({"width": width, "height": 900})
    page.add_init_script(WATCH_CANVAS_TEXT)
    log_in(page, gateway_server.url, "analyst")

    page.goto(f"{gateway_server.url}/portal/acme/usage/")
    page.wait_for_function("document.getElementById('tokens-chart').uplot !== undefined")
    labels: dict[str, list[str]] = {}
    for chart_id in ("spend-chart", "tokens-chart"):
        drawn = page.evaluate(CHART_TEXTS, chart_id)
        box = drawn["chart"]
        assert drawn["texts"], f"{chart_id}: no axis labels drawn"
        for text in drawn["texts"]:
            assert text["left"] >= box["left"] - 0.5 and text["right"] <= box["right"] + 0.5, (
                f"{chart_id} at {width}px: {text['text']!r} is cut off ({text} vs {box})"
            )
            assert text["top"] >= box["top"] - 0.5 and text["bottom"] <= box["bottom"] + 0.5, (
                f"{chart_id} at {width}px: {text['text']!r} is cut off ({text} vs {box})"
            )
        labels[chart_id] = [t["text"] for t in drawn["texts"]]
    assert any(re.fullmatch(r"\d+(\.\d+)?M", text) for text in labels["tokens-chart"]), labels
    assert any(re.fullmatch(r"\$\d+(\.\d+)?K", text) for text in labels["spend-chart"]), labels
    screenshot(page, f"portal-usage-charts-{width}px")
