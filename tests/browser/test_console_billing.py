"""The console's prices, budgets and usage pages in a real browser, on a desktop and on a
phone: set a price, set a budget, filter usage and download its CSV, a bad input shows its
message, and no page scrolls sideways."""

from __future__ import annotations

import csv
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
import redis
from django.utils import timezone
from playwright.sync_api import Page, expect

from metering.models import PriceSheet, UsageEvent
from tenants.actions import do_create_tenant
from tenants.models import Quota, Tenant
from tests.browser.conftest import assert_fits, log_in, make_user, screenshot
from tests.gateway.conftest import GatewayServer
from tests.registry.conftest import make_model

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def billing_data(transactional_db: None, redis_client: redis.Redis) -> Tenant:
    """Staff, one tenant, one model, and three requests of the last hour (one failed)."""
    make_user("ops", is_staff=True)
    acme = do_create_tenant("acme", "Acme")
    make_model("llama-3.1-8b")
    now = timezone.now()
    for n, status in enumerate(["ok", "error", "ok"]):
        at = now - timedelta(minutes=30 + n)
        UsageEvent.objects.create(
            request_id=f"req-browser-{n}",
            tenant_id=acme.pk,
            model="llama-3.1-8b",
            priority="standard",
            prompt_tokens=120,
            cached_prompt_tokens=0,
            completion_tokens=30,
            status=status,
            queue_ms=1.0,
            ttft_ms=80.0,
            total_ms=300.0,
            price_charged_usd_micros=6_100,
            pool="h100-us-east",
            replica_id="r1",
            started_at=at,
            ended_at=at,
        )
    return acme


@pytest.mark.parametrize("width", [1280, 390])
def test_staff_set_a_price_and_a_budget_and_export_filtered_usage(
    gateway_server: GatewayServer, billing_data: Tenant, page: Page, width: int, tmp_path: Any
) -> None:
    page.set_viewport_size({"width": width, "height": 900})
    log_in(page, gateway_server.url, "ops")

    # A price: a bad one is refused with its message, then a good one is in force.
    page.goto(f"{gateway_server.url}/console/prices/")
    assert_fits(page, "prices")
    form = page.locator("#price-form")
    form.locator("[name=input_usd_per_mtok]").fill("-1")
    form.locator("[name=cached_input_usd_per_mtok]").fill("0.05")
    form.locator("[name=output_usd_per_mtok]").fill("0.60")
    form.locator("button[type=submit]").click()
    expect(page.locator(".messages")).to_contain_text("Not saved: Input price")
    assert not PriceSheet.objects.exists()
    page.locator("#price-form [name=input_usd_per_mtok]").fill("0.20")
    page.locator("#price-form button[type=submit]").click()
    expect(page.locator(".messages")).to_contain_text("Price sheet for llama-3.1-8b (list price)")
    expect(page.locator("#price-sheets")).to_contain_text("in force")
    assert PriceSheet.objects.get().output_usd_per_mtok == Decimal("0.6")
    assert_fits(page, "prices")
    screenshot(page, f"console-prices-{width}")

    # A budget: over 100 % is refused, then 250 USD alerting at 75 % is saved.
    page.goto(f"{gateway_server.url}/console/budgets/")
    assert_fits(page, "budgets")
    page.click("#budgets [data-tenant=acme] a")
    budget = page.locator("#budget-form")
    budget.locator("[name=monthly_spend_budget_usd]").fill("250")
    budget.locator("[name=soft_alert_percent]").fill("150")
    budget.locator("button[type=submit]").click()
    expect(page.locator(".messages")).to_contain_text("Alert threshold")
    assert Quota.objects.get(tenant=billing_data).monthly_spend_budget_usd is None
    page.locator("#budget-form [name=monthly_spend_budget_usd]").fill("250")
    page.locator("#budget-form [name=soft_alert_percent]").fill("75")
    page.locator("#budget-form button[type=submit]").click()
    expect(page.locator(".messages")).to_contain_text("Budget of Acme saved.")
    quota = Quota.objects.get(tenant=billing_data)
    assert (quota.monthly_spend_budget_usd, quota.soft_alert_fraction) == (250, 0.75)
    assert_fits(page, "budget")
    screenshot(page, f"console-budget-{width}")

    # Usage: a bad date shows its message; the failed request alone, and its CSV.
    page.goto(f"{gateway_server.url}/console/usage/")
    expect(page.locator("#usage-events tbody tr")).to_have_count(3)
    assert_fits(page, "usage")
    page.fill("#usage-form [name=start]", "last tuesday")
    page.click("#usage-form button[type=submit]")
    expect(page.locator("#usage-error")).to_contain_text("From: Expected an ISO 8601")
    page.fill("#usage-form [name=start]", "")
    page.select_option("#usage-form [name=status]", "error")
    page.click("#usage-form button[type=submit]")
    expect(page.locator("#usage-events tbody tr")).to_have_count(1)
    expect(page.locator("#usage-events")).to_contain_text("req-browser-1")
    assert "status=error" in page.url
    with page.expect_download() as download_info:
        page.click("#usage-csv")
    saved = tmp_path / "usage.csv"
    download_info.value.save_as(saved)
    with saved.open() as file:
        rows = list(csv.DictReader(file))
    assert [(r["request_id"], r["status"], r["tenant"]) for r in rows] == [
        ("req-browser-1", "error", "acme")
    ]
    assert_fits(page, "usage")
    screenshot(page, f"console-usage-{width}")
