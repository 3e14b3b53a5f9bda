"""The console's billing page: margin in dollars always, as a percentage only when revenue is
large enough for one to mean something, and what cost to serve includes."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from metering.models import HourlyRollup, ReplicaHour
from metering.rollups import empty_buckets, hour_floor


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
    assert "n/a — revenue under $10.00" in cell
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


def test_the_billing_page_charges_the_fleets_ready_time_with_idle_as_its_own_cost(
    db: None,
) -> None:
    hour = hour_floor(timezone.now() - timedelta(hours=2))
    rollup("demo-8b", "h100-us-east", revenue_usd=0.0061, cost_usd=0.0004)
    ReplicaHour.objects.create(
        hour=hour,
        replica_id="9",
        deployment_id=1,
        model="demo-8b",
        pool="h100-us-east",
        gpus=2,
        usd_micros_per_gpu_hour=3_490_000,
        ready_us=1_800_000_000,
        requests=3,
        gpu_seconds=3600.0,
        idle_gpu_seconds=3599.0,
        cost_usd_micros=3_490_000,
        idle_usd_micros=3_489_600,
        as_of=hour + timedelta(hours=1),
    )
    page = billing_page()
    assert '<dd id="fleet-gpu-seconds">3,600</dd>' in page
    assert '<dd id="fleet-cost">$3.49</dd>' in page
    assert '<dd id="idle-cost">$3.49</dd>' in page
    assert '<dd id="revenue">$0.0061</dd>' in page
    tenant_rows = page[page.index('id="margins-by-tenant"') :]
    assert 'data-key="idle"' in tenant_rows


def test_the_router_page_shows_the_saving_against_least_load_by_pool(db: None) -> None:
    row = rollup("demo-8b", "l40s-eu-west", revenue_usd=0.02, cost_usd=0.0040)
    HourlyRollup.objects.filter(pk=row.pk).update(baseline_cost_usd_micros=10_100)
    staff = get_user_model().objects.create_user("ops", password="pw-for-tests", is_staff=True)
    client = Client()
    client.force_login(staff)
    page = client.get("/console/router/").content.decode()
    assert '<span id="total-saving">$0.0061</span>' in page
    pools = page[page.index('id="saving-by-pool"') :]
    assert 'data-key="l40s-eu-west"' in pools and "$0.0061" in pools
