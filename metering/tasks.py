"""Celery tasks of the metering app: each idempotent, safe to run twice or after a crash."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.utils import timezone

from config.celery import task
from config.loops import LoopPass
from config.redis import redis_client
from metering import budgets, ingest, invoices, partitions, prices, rollups
from tenants.models import Tenant

# Keep the consumer object (and its name) for the life of the worker process, so its own
# pending entries are re-read first after a failed batch.
_consumer: ingest.Consumer | None = None

INVOICE_CLOSE_GRACE = timedelta(days=1)


@task(name="metering.ingest", ignore_result=True)
def ingest_usage() -> int:
    """Beat runs this every second; each run drains for up to ~0.9 s. Several workers may run
    it at once: each is its own consumer in the group."""
    global _consumer
    if _consumer is None:
        _consumer = ingest.Consumer(redis_client(worker=True), ingest.consumer_name())
    return _consumer.drain(max_seconds=0.9).inserted


@task(name="metering.rollup_recent_hours", ignore_result=True)
def rollup_recent_hours() -> None:
    """Recompute the current and the previous hour (late events land in the previous one)."""
    now = timezone.now()
    for hour in (now - timedelta(hours=1), now):
        rollups.recompute_hour(rollups.hour_floor(hour), now)


@task(name="metering.rollup_hour", ignore_result=True)
def rollup_hour(hour_iso: str) -> None:
    rollups.recompute_hour(datetime.fromisoformat(hour_iso))


@task(name="metering.refresh_invoices", ignore_result=True)
def refresh_invoices() -> None:
    """Refresh this month's drafts; close last month's once the grace period has passed."""
    now = timezone.now()
    this_month = now.date().replace(day=1)
    last_month = (this_month - timedelta(days=1)).replace(day=1)
    close_last = now - INVOICE_CLOSE_GRACE >= datetime(
        this_month.year, this_month.month, 1, tzinfo=UTC
    )
    this_pass = LoopPass("invoices", "tenant")
    for tenant in Tenant.objects.order_by("pk"):
        with this_pass.item(tenant.pk):  # one tenant's failure leaves the others' invoices be
            invoices.do_build_invoice(tenant, this_month, finalize=False)
            invoices.do_build_invoice(tenant, last_month, finalize=close_last)
    this_pass.record(redis_client())


@task(name="metering.check_budgets", ignore_result=True)
def check_budgets() -> None:
    month = timezone.now().date().replace(day=1)
    client = redis_client(worker=True)
    this_pass = LoopPass("budgets", "tenant")
    try:
        budgeted = Tenant.objects.filter(quota__monthly_spend_budget_usd__isnull=False)
        for tenant in budgeted.order_by("pk"):
            with this_pass.item(tenant.pk, savepoint=False):  # each alert commits, then goes out
                budgets.check_tenant_budget(client, tenant, month)
        this_pass.record(client)
    finally:
        client.close()


@task(name="metering.publish_prices", ignore_result=True)
def publish_prices() -> None:
    prices.publish_price_book()


@task(name="metering.maintain_partitions", ignore_result=True)
def maintain_partitions() -> None:
    """Hourly: the usage table's partitions for this month and the next two exist, and those
    past the retention are dropped (metering.partitions)."""
    now = timezone.now()
    partitions.ensure_partitions(now)
    partitions.drop_expired(now, retention_months=settings.USAGE_RETENTION_MONTHS)
