"""Serializers of the metering API.

Money goes out as decimal strings of USD (six places, exact: summed from integer micro-USD).
Cost to serve and GPU-seconds are the platform's own figures (with revenue they give the
margin, which is staff-only), so a tenant's caller never sees them: `StaffOnlyFieldsMixin`
drops them for anyone but staff.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from config.api import BoundedDateTimeField, FloatField, PlatformModelSerializer
from metering.api.filters import MonthField
from metering.invoices import INVOICE_LINE_FIELDS
from metering.models import (
    HourlyRollup,
    Invoice,
    InvoiceLine,
    PriceSheet,
    UsageEvent,
    micros_to_usd,
)
from metering.rollups import percentile_ms
from tenants.models import Tenant

USD = {"max_digits": 24, "decimal_places": 6, "coerce_to_string": True}
RATE = {"max_digits": 12, "decimal_places": 6, "min_value": Decimal("0")}


class StaffOnlyFieldsMixin:
    staff_only_fields: tuple[str, ...] = ()

    def to_representation(self, instance: Any) -> dict[str, Any]:
        data: dict[str, Any] = super().to_representation(instance)  # type: ignore[misc]
        request = self.context.get("request")  # type: ignore[attr-defined]
        if not getattr(getattr(request, "user", None), "is_staff", False):
            for name in self.staff_only_fields:
                data.pop(name, None)
        return data


# ------------------------------------------------------------------------------- usage


class UsageEventSerializer(StaffOnlyFieldsMixin, PlatformModelSerializer[UsageEvent]):
    staff_only_fields = ("replica_id", "prefill_replica_id", "gpu_seconds", "cost_to_serve_usd")
    price_charged_usd = serializers.SerializerMethodField()
    cost_to_serve_usd = serializers.SerializerMethodField(help_text="Staff only.")
    tpot_ms = FloatField(
        read_only=True,
        allow_null=True,
        help_text="Time per output token after the first: (total_ms - ttft_ms) / "
        "(completion_tokens - 1); null under two tokens.",
    )
    slo_outcome = serializers.ChoiceField(
        choices=["met", "ttft", "tpot", "failed"],
        read_only=True,
        allow_null=True,
        help_text="Against the tier's objectives, both clocks: met, the clock missed (ttft "
        "first), or failed; null when not judged (batch, or a client that hung up).",
    )

    class Meta:
        model = UsageEvent
        fields = [
            "request_id",
            "tenant_id",
            "key_id",
            "model",
            "version_id",
            "adapter",
            "deployment_id",
            "pool",
            "replica_id",
            "prefill_pool",
            "prefill_replica_id",
            "priority",
            "prompt_tokens",
            "cached_prompt_tokens",
            "completion_tokens",
            "status",
            "finish_reason",
            "queue_ms",
            "ttft_ms",
            "tpot_ms",
            "slo_outcome",
            "total_ms",
            "started_at",
            "ended_at",
            "price_charged_usd",
            "gpu_seconds",
            "cost_to_serve_usd",
            "trace_id",
        ]
        extra_kwargs = {
            "replica_id": {"help_text": "Staff only."},
            "prefill_pool": {
                "help_text": "Where a disaggregated request's prompt was prefilled; empty "
                "for a request served whole on one replica (`pool`)."
            },
            "prefill_replica_id": {"help_text": "Staff only."},
            "gpu_seconds": {"help_text": "Staff only."},
        }

    @extend_schema_field(OpenApiTypes.DECIMAL)
    def get_price_charged_usd(self, event: UsageEvent) -> str:
        return _usd(event.price_charged_usd_micros)

    @extend_schema_field(OpenApiTypes.DECIMAL)
    def get_cost_to_serve_usd(self, event: UsageEvent) -> str:
        return _usd(event.cost_to_serve_usd_micros)


class UsageBucketSerializer(serializers.Serializer[dict[str, Any]]):
    period = serializers.DateTimeField(help_text="Start of the hour, day or month (UTC).")
    requests = serializers.IntegerField()
    errors = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    cached_prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    spend_usd = serializers.DecimalField(**USD)


class UsageTotalsSerializer(UsageBucketSerializer):
    period = None


class UsageReportSerializer(serializers.Serializer[dict[str, Any]]):
    tenant = serializers.CharField()
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    granularity = serializers.CharField()
    model = serializers.CharField(allow_null=True)
    key = serializers.IntegerField(allow_null=True)
    totals = UsageTotalsSerializer()
    buckets = UsageBucketSerializer(many=True, help_text="Periods without requests are left out.")


# ------------------------------------------------------------------------------ rollups


class RollupSerializer(StaffOnlyFieldsMixin, PlatformModelSerializer[HourlyRollup]):
    staff_only_fields = ("gpu_seconds", "cost_to_serve_usd")
    revenue_usd = serializers.SerializerMethodField()
    cost_to_serve_usd = serializers.SerializerMethodField(help_text="Staff only.")
    ttft_p50_ms = serializers.SerializerMethodField()
    ttft_p95_ms = serializers.SerializerMethodField()
    total_p50_ms = serializers.SerializerMethodField()
    total_p95_ms = serializers.SerializerMethodField()

    class Meta:
        model = HourlyRollup
        fields = [
            "id",
            "hour",
            "tenant_id",
            "model",
            "adapter",
            "pool",
            "tier",
            "requests",
            "errors",
            "prompt_tokens",
            "cached_prompt_tokens",
            "completion_tokens",
            "revenue_usd",
            "gpu_seconds",
            "cost_to_serve_usd",
            "ttft_p50_ms",
            "ttft_p95_ms",
            "total_p50_ms",
            "total_p95_ms",
            "ttft_buckets",
            "total_buckets",
        ]
        extra_kwargs = {"gpu_seconds": {"help_text": "Staff only."}}

    @extend_schema_field(OpenApiTypes.DECIMAL)
    def get_revenue_usd(self, rollup: HourlyRollup) -> str:
        return _usd(rollup.revenue_usd_micros)

    @extend_schema_field(OpenApiTypes.DECIMAL)
    def get_cost_to_serve_usd(self, rollup: HourlyRollup) -> str:
        return _usd(rollup.cost_to_serve_usd_micros)

    # Percentiles are read from the hour's buckets (upper bound of the bucket), never averaged.
    @extend_schema_field(OpenApiTypes.FLOAT)
    def get_ttft_p50_ms(self, rollup: HourlyRollup) -> float | None:
        return percentile_ms(rollup.ttft_buckets, 0.5)

    @extend_schema_field(OpenApiTypes.FLOAT)
    def get_ttft_p95_ms(self, rollup: HourlyRollup) -> float | None:
        return percentile_ms(rollup.ttft_buckets, 0.95)

    @extend_schema_field(OpenApiTypes.FLOAT)
    def get_total_p50_ms(self, rollup: HourlyRollup) -> float | None:
        return percentile_ms(rollup.total_buckets, 0.5)

    @extend_schema_field(OpenApiTypes.FLOAT)
    def get_total_p95_ms(self, rollup: HourlyRollup) -> float | None:
        return percentile_ms(rollup.total_buckets, 0.95)


# ----------------------------------------------------------------------------- invoices


class InvoiceLineSerializer(PlatformModelSerializer[InvoiceLine]):
    class Meta:
        model = InvoiceLine
        fields = list(INVOICE_LINE_FIELDS)


class InvoiceSerializer(PlatformModelSerializer[Invoice]):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    lines = InvoiceLineSerializer(many=True, read_only=True)
    month = MonthField(read_only=True)

    class Meta:
        model = Invoice
        fields = [
            "id",
            "tenant",
            "month",
            "status",
            "total_usd",
            "created_at",
            "finalized_at",
            "lines",
        ]


class CloseMonthSerializer(serializers.Serializer[Any]):
    tenant = serializers.SlugRelatedField(slug_field="slug", queryset=Tenant.objects.all())
    month = MonthField(help_text="YYYY-MM")


# ------------------------------------------------------------------------- price sheets


class PriceSheetSerializer(PlatformModelSerializer[PriceSheet]):
    tenant = serializers.SlugRelatedField(
        slug_field="slug",
        queryset=Tenant.objects.all(),
        allow_null=True,
        required=False,
        help_text="A tenant's own price; null is the list price.",
    )
    input_usd_per_mtok = serializers.DecimalField(**RATE)
    cached_input_usd_per_mtok = serializers.DecimalField(**RATE)
    output_usd_per_mtok = serializers.DecimalField(**RATE)
    tier_multipliers = serializers.DictField(
        child=serializers.DecimalField(max_digits=8, decimal_places=4, min_value=Decimal("0")),
        required=False,
        help_text='Per tier, e.g. {"interactive": "1.25", "batch": "0.5"}; a missing tier is 1.',
    )
    effective_from = BoundedDateTimeField()
    effective_until = serializers.DateTimeField(
        read_only=True,
        allow_null=True,
        help_text="When the next sheet for the same model, adapter and tenant takes over.",
    )

    class Meta:
        model = PriceSheet
        fields = [
            "id",
            "model",
            "adapter",
            "tenant",
            "input_usd_per_mtok",
            "cached_input_usd_per_mtok",
            "output_usd_per_mtok",
            "tier_multipliers",
            "effective_from",
            "effective_until",
            "created_at",
        ]
        read_only_fields = ["id", "created_at"]
        # The unique constraint is checked in validate(): DRF's generated validator skips a
        # row whose tenant is null, and the list price is exactly that row.
        validators: list[Any] = []

    def validate_tier_multipliers(self, value: dict[str, Decimal]) -> dict[str, str]:
        # "0.5", not the field's "0.5000": the sheet stores what staff wrote.
        return {tier: f"{multiplier.normalize():f}" for tier, multiplier in value.items()}

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        def current(name: str, default: Any = None) -> Any:
            if name in attrs:
                return attrs[name]
            return getattr(self.instance, name, default)

        clash = PriceSheet.objects.filter(
            model=current("model"),
            adapter=current("adapter", ""),
            tenant=current("tenant"),
            effective_from=current("effective_from"),
        )
        if self.instance is not None:
            clash = clash.exclude(pk=self.instance.pk)
        if clash.exists():
            raise serializers.ValidationError(
                {"effective_from": "A sheet for this model, adapter and tenant starts then."}
            )
        return attrs


# ------------------------------------------------------------------------------- margin


class MarginRowSerializer(serializers.Serializer[dict[str, Any]]):
    key = serializers.CharField(help_text="The model, pool or tenant slug; `idle` by tenant.")
    requests = serializers.IntegerField()
    gpu_seconds = FloatField(help_text="GPU time charged: requests' plus idle.")
    idle_gpu_seconds = FloatField(help_text="Ready GPU time no request used.")
    revenue_usd = serializers.DecimalField(**USD)
    request_cost_usd = serializers.DecimalField(**USD, help_text="The requests' work.")
    idle_cost_usd = serializers.DecimalField(**USD)
    cost_usd = serializers.DecimalField(**USD, help_text="Cost to serve: request plus idle.")
    margin_usd = serializers.DecimalField(**USD)
    margin_pct = FloatField(
        allow_null=True, help_text="Of revenue; null under $10 of revenue, where it means nothing."
    )
    least_load_request_cost_usd = serializers.DecimalField(
        **USD, help_text="The same requests' work where least load would have sent them."
    )
    saving_vs_least_load_usd = serializers.DecimalField(
        **USD, help_text="least_load_request_cost_usd - request_cost_usd."
    )


MARGIN_COLUMNS: tuple[str, ...] = tuple(MarginRowSerializer().fields)


class MarginTotalsSerializer(MarginRowSerializer):
    fleet_gpu_seconds = FloatField(help_text="Ready GPU time of the whole fleet.")
    fleet_cost_usd = serializers.DecimalField(**USD, help_text="That time at the pools' prices.")
    as_of = serializers.DateTimeField(
        allow_null=True, help_text="Ready time is counted up to here (the last recompute)."
    )


class MarginReportSerializer(serializers.Serializer[dict[str, Any]]):
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    by = serializers.CharField()
    totals = MarginTotalsSerializer()
    rows = MarginRowSerializer(many=True)


def _usd(micros: int) -> str:
    return str(micros_to_usd(micros))
