"""The console's billing page: margin in dollars always, as a percentage only when revenue is
large enough for one to mean something, and what cost to serve includes."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from metering.models import HourlyRollup
from metering.rollups import empty_buckets, hour_floor
from metering.views import MARGIN_PCT_MIN_REVENUE_USD, margin_as_shown


def row(revenue_usd: float, cost_usd: float) -> dict[str, Any]:
    margin = revenue_usd - cost_usd
    return {
        "revenue_usd": revenue_usd,
        "cost_usd": cost_usd,
        "margin_usd": margin,
        "margin_pct": margin / revenue_usd * 100 if revenue_usd else None,
    }


def test_a_margin_on_tiny_revenue_has_no_percentage() -> None:
    shown = margin_as_shown(row(revenue_usd=0.05, cost_usd=2.0))
    assert shown["margin_pct"] is None
    assert shown["margin_usd"] == pytest.approx(-1.95)
    assert shown["margin_abs_usd"] == pytest.approx(1.95)


def test_a_margin_on_revenue_at_the_floor_keeps_its_percentage() -> None:
    shown = margin_as_shown(row(revenue_usd=MARGIN_PCT_MIN_REVENUE_USD, cost_usd=2.5))
    assert shown["margin_pct"] == pytest.approx(75.0)


def test_a_margin_on_no_revenue_has_no_percentage() -> None:
    assert margin_as_shown(row(revenue_usd=0.0, cost_usd=1.0))["margin_pct"] is None


def rollup(model: str, pool: str, revenue_usd: float, cost_usd: float) -> HourlyRollup:
    return HourlyRollup.objects.create(
        hour=hour_floor(timezone.now() - timedelta(hours=2)),
        tenant_id=1,
        model=model,
        adapter="",
        pool=pool,
        tier="standard",
        requests=3,
        errors=0,
        prompt_tokens=300,
        cached_prompt_tokens=0,
        completion_tokens=90,
        gpu_seconds=3600.0,
        cost_to_serve_usd_micros=round(cost_usd * 1e6),
        revenue_usd_micros=round(revenue_usd * 1e6),
        ttft_buckets=empty_buckets(),
        total_buckets=empty_buckets(),
    )


def billing_page() -> str:
    staff = get_user_model().objects.create_user("ops", password="pw-for-tests", is_staff=True)
    client = Client()
    client.force_login(staff)
    reply = client.get("/console/billing/")
    assert reply.status_code == 200
    return reply.content.decode()


def margin_cell(page: str, model: str) -> str:
    row_start = page.index(f"<td>{model}</td>")
    cell_start = page.index('<td class="margin', row_start)
    return page[cell_start : page.index("</td>", cell_start)]


def test_the_billing_page_shows_tiny_revenue_margins_in_dollars_only(db: None) -> None:
    rollup("demo-8b", "h100-us-east", revenue_usd=0.04, cost_usd=1.64)
    cell = margin_cell(billing_page(), "demo-8b")
    assert "−$1.60" in cell
    assert f"n/a — revenue under ${MARGIN_PCT_MIN_REVENUE_USD:.0f}" in cell
    assert "%" not in cell.split("n/a")[0], "no percentage before the n/a note"
    assert "loss" in cell


def test_the_billing_page_shows_the_percentage_of_a_real_revenue(db: None) -> None:
    rollup("llama-70b", "h100-us-east", revenue_usd=1_250.0, cost_usd=1_000.0)
    cell = margin_cell(billing_page(), "llama-70b")
    assert "$250.00" in cell and "(20 %)" in cell
    assert "n/a" not in cell and "loss" not in cell


def test_the_billing_page_says_cost_to_serve_includes_idle_gpu_time(db: None) -> None:
    page = billing_page()
    assert 'id="cost-to-serve-note"' in page
    assert "idle time included" in page
