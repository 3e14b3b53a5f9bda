"""Models of the metering app: usage events, price sheets, rollups, invoices, budget alerts.

Money: events, rollups and invoice lines sum integer micro-USD (exact, no float drift);
invoice totals and price sheets are also kept as Decimal USD for people and exports.

The usage-event table is written in bulk (COPY) and read by tenant and time. It stores ids,
not foreign keys: a constraint check per row would slow the bulk insert, and an event must be
kept even after its key, version or deployment is deleted. It has a BRIN index on `started_at`
(rows arrive in time order, so a BRIN range summary stays tight and costs a few pages at
hundreds of millions of rows) and a B-tree on (tenant_id, started_at) for per-tenant queries.
In PostgreSQL it is partitioned by month of `started_at` with the primary key (request_id,
started_at), which this model does not declare (migration 0004, metering.partitions): a column
added here reaches every partition, and partitions made later copy the parent's columns.
"""

from __future__ import annotations

from decimal import Decimal

from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import BrinIndex
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from config.nul import validate_no_nul
from metering.usage import JudgedOnBothClocks
from registry.models import SERVED_NAME
from tenants.models import Tenant

MICROS = Decimal("0.000001")


def micros_to_usd(micros: int) -> Decimal:
    return (Decimal(micros) * MICROS).quantize(MICROS)


class UsageEvent(JudgedOnBothClocks, models.Model):
    """One request, as the gateway settled it (see metering.usage.UsageEvent)."""

    request_id = models.CharField(max_length=64, primary_key=True)
    tenant_id = models.BigIntegerField()
    key_id = models.BigIntegerField(null=True)
    model = models.CharField(max_length=128)
    version_id = models.BigIntegerField(null=True)
    adapter = models.CharField(max_length=128, blank=True)
    deployment_id = models.BigIntegerField(null=True)
    pool = models.CharField(max_length=64, blank=True)
    replica_id = models.CharField(max_length=64, blank=True)
    priority = models.CharField(max_length=16)
    prompt_tokens = models.IntegerField()
    cached_prompt_tokens = models.IntegerField()
    completion_tokens = models.IntegerField()
    status = models.CharField(max_length=20)
    finish_reason = models.CharField(max_length=32, blank=True)
    queue_ms = models.FloatField()
    ttft_ms = models.FloatField(null=True)
    total_ms = models.FloatField()
    gpu_seconds = models.FloatField(default=0.0)
    cost_to_serve_usd_micros = models.BigIntegerField(default=0)
    price_charged_usd_micros = models.BigIntegerField(default=0)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()
    # Where least load would have sent it, and what its work would have cost there (metering.cost).
    baseline_replica_id = models.CharField(max_length=64, blank=True, default="")
    baseline_pool = models.CharField(max_length=64, blank=True, default="")
    baseline_cost_usd_micros = models.BigIntegerField(default=0)
    # The request's OpenTelemetry trace id, "" when it was not traced.
    trace_id = models.CharField(max_length=32, blank=True, default="")
    # Where a disaggregated request's prompt was prefilled ("" when it was colocated):
    # replica_id and pool are then its decode replica's.
    prefill_replica_id = models.CharField(max_length=64, blank=True, default="")
    prefill_pool = models.CharField(max_length=64, blank=True, default="")

    class Meta:
        indexes = [
            BrinIndex(fields=["started_at"], name="usage_started_brin"),
            models.Index(fields=["tenant_id", "started_at"], name="usage_tenant_time"),
        ]

    def __str__(self) -> str:
        return self.request_id


class PriceSheet(models.Model):
    """The price of a model (or one adapter of it), from `effective_from` until the next
    sheet for the same model, adapter and tenant. A tenant's own sheet overrides the list."""

    # Named as the registry names them (a price may be set before the model is registered):
    # a model's served name, and an adapter's, which follows the same rule.
    model = models.CharField(max_length=128, validators=[SERVED_NAME])
    adapter = models.CharField(
        max_length=128, blank=True, validators=[SERVED_NAME], help_text="Empty = the base model."
    )
    tenant = models.ForeignKey(
        Tenant,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="price_sheets",
        help_text="Empty = the list price for everyone.",
    )
    input_usd_per_mtok = models.DecimalField(max_digits=12, decimal_places=6)
    cached_input_usd_per_mtok = models.DecimalField(max_digits=12, decimal_places=6)
    output_usd_per_mtok = models.DecimalField(max_digits=12, decimal_places=6)
    tier_multipliers = models.JSONField(
        default=dict,
        blank=True,
        help_text='e.g. {"interactive": "1.25", "batch": "0.5"}',
        validators=[validate_no_nul],
    )
    effective_from = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model", "adapter", "effective_from"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "adapter", "tenant", "effective_from"],
                name="price_sheet_once",
                nulls_distinct=False,
            )
        ]

    def __str__(self) -> str:
        who = self.tenant_id or "list"
        return f"{self.model}/{self.adapter or '-'} ({who}) from {self.effective_from:%Y-%m-%d}"


class TenantDiscount(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="discounts")
    percent = models.DecimalField(
        max_digits=5,
        decimal_places=2,
        validators=[MinValueValidator(Decimal("0")), MaxValueValidator(Decimal("100"))],
    )
    effective_from = models.DateTimeField()

    class Meta:
        ordering = ["tenant", "effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "effective_from"], name="discount_once")
        ]

    def __str__(self) -> str:
        return f"{self.percent}% off for {self.tenant} from {self.effective_from:%Y-%m-%d}"


class HourlyRollup(models.Model):
    """Usage of one hour per tenant, model, adapter, pool and tier. Recomputing an hour
    replaces its rows. Latency histograms count requests per bucket of LATENCY_BUCKETS_MS
    (metering.rollups); percentiles are read from merged buckets, never averaged."""

    hour = models.DateTimeField()
    tenant_id = models.BigIntegerField()
    model = models.CharField(max_length=128)
    adapter = models.CharField(max_length=128, blank=True)
    pool = models.CharField(max_length=64, blank=True)
    tier = models.CharField(max_length=16)
    requests = models.BigIntegerField()
    errors = models.BigIntegerField()
    prompt_tokens = models.BigIntegerField()
    cached_prompt_tokens = models.BigIntegerField()
    completion_tokens = models.BigIntegerField()
    gpu_seconds = models.FloatField()
    cost_to_serve_usd_micros = models.BigIntegerField()
    revenue_usd_micros = models.BigIntegerField()
    # What the same requests would have cost where least load would have sent them.
    baseline_cost_usd_micros = models.BigIntegerField(default=0)
    ttft_buckets = ArrayField(models.BigIntegerField())
    total_buckets = ArrayField(models.BigIntegerField())

    class Meta:
        ordering = ["hour"]
        constraints = [
            models.UniqueConstraint(
                fields=["hour", "tenant_id", "model", "adapter", "pool", "tier"],
                name="rollup_once",
            )
        ]
        indexes = [models.Index(fields=["tenant_id", "hour"], name="rollup_tenant_hour")]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}h {self.tenant_id} {self.model}"


class ReplicaHour(models.Model):
    """One replica's GPU time in one hour (metering.ledger), and how it was split: what its
    requests were charged and the idle rest. Recomputing an hour replaces its rows.

    `cost_usd_micros` is `gpus x ready time x price`; `idle_usd_micros` the part no request
    was charged, so the hour's request costs plus its idle costs add up to the sum of
    `cost_usd_micros`, to the micro-USD."""

    hour = models.DateTimeField()
    replica_id = models.CharField(max_length=64)
    deployment_id = models.BigIntegerField()
    model = models.CharField(max_length=128)
    pool = models.CharField(max_length=64)
    gpus = models.PositiveSmallIntegerField()
    usd_micros_per_gpu_hour = models.BigIntegerField()
    ready_us = models.BigIntegerField()
    requests = models.BigIntegerField()
    gpu_seconds = models.FloatField()
    idle_gpu_seconds = models.FloatField()
    cost_usd_micros = models.BigIntegerField()
    idle_usd_micros = models.BigIntegerField()
    # The moment the hour was computed for: an open hour counts ready time up to here.
    as_of = models.DateTimeField()

    class Meta:
        ordering = ["hour", "replica_id"]
        constraints = [
            models.UniqueConstraint(fields=["hour", "replica_id"], name="replica_hour_once")
        ]

    def __str__(self) -> str:
        return f"replica {self.replica_id} at {self.hour:%Y-%m-%d %H:00}"


class Invoice(models.Model):
    class Status(models.TextChoices):
        DRAFT = "draft"
        FINALIZED = "finalized"

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="invoices")
    month = models.DateField(help_text="The first day of the billed month (UTC).")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.DRAFT)
    total_usd_micros = models.BigIntegerField(default=0)
    total_usd = models.DecimalField(max_digits=18, decimal_places=6, default=Decimal("0"))
    created_at = models.DateTimeField(auto_now_add=True)
    finalized_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-month", "tenant"]
        constraints = [models.UniqueConstraint(fields=["tenant", "month"], name="invoice_once")]

    def __str__(self) -> str:
        return f"{self.tenant} {self.month:%Y-%m} ({self.status})"


class InvoiceLine(models.Model):
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    model = models.CharField(max_length=128)
    requests = models.BigIntegerField()
    prompt_tokens = models.BigIntegerField()
    cached_prompt_tokens = models.BigIntegerField()
    completion_tokens = models.BigIntegerField()
    amount_usd_micros = models.BigIntegerField()
    amount_usd = models.DecimalField(max_digits=18, decimal_places=6)

    class Meta:
        ordering = ["invoice", "model"]
        constraints = [
            models.UniqueConstraint(fields=["invoice", "model"], name="invoice_line_once")
        ]

    def __str__(self) -> str:
        return f"{self.invoice}: {self.model}"


class CostCenter(models.Model):
    """Chargeback mapping: a tenant is a team; this names its team and cost center."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="cost_center")
    team = models.CharField(max_length=200)
    code = models.CharField(max_length=64, help_text="The finance cost-center code.")

    def __str__(self) -> str:
        return f"{self.team} ({self.code})"


class BudgetWebhook(models.Model):
    """Where budget alerts are POSTed, signed with HMAC-SHA256 of `timestamp.body`."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="budget_webhook")
    url = models.URLField()
    secret = models.CharField(max_length=128)
    active = models.BooleanField(default=True)

    def __str__(self) -> str:
        return self.url


class BudgetAlert(models.Model):
    """One alert per tenant, month and threshold: the unique row is what makes it once."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="budget_alerts")
    month = models.DateField()
    threshold_percent = models.PositiveSmallIntegerField()
    spend_usd_micros = models.BigIntegerField()
    budget_usd_micros = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    emailed = models.BooleanField(default=False)
    webhook_status = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "month", "threshold_percent"], name="budget_alert_once"
            )
        ]

    def __str__(self) -> str:
        return f"{self.tenant} {self.month:%Y-%m} {self.threshold_percent}%"


class Notice(models.Model):
    """A message the console shows to a tenant's members (or to staff when tenant is empty)."""

    class Level(models.TextChoices):
        INFO = "info"
        WARNING = "warning"
        CRITICAL = "critical"

    tenant = models.ForeignKey(
        Tenant, on_delete=models.CASCADE, null=True, blank=True, related_name="notices"
    )
    level = models.CharField(max_length=16, choices=Level.choices, default=Level.INFO)
    title = models.CharField(max_length=200)
    body = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    read_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.title
