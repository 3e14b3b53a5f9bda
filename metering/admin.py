"""Django admin registrations of the metering app."""

from __future__ import annotations

from django.contrib import admin

from metering.models import (
    BudgetAlert,
    BudgetWebhook,
    CostCenter,
    HourlyRollup,
    Invoice,
    InvoiceLine,
    Notice,
    PriceSheet,
    TenantDiscount,
    UsageEvent,
)


@admin.register(PriceSheet)
class PriceSheetAdmin(admin.ModelAdmin[PriceSheet]):
    list_display = [
        "model",
        "adapter",
        "tenant",
        "input_usd_per_mtok",
        "output_usd_per_mtok",
        "effective_from",
    ]
    list_filter = ["model", "tenant"]


@admin.register(UsageEvent)
class UsageEventAdmin(admin.ModelAdmin[UsageEvent]):
    list_display = ["request_id", "tenant_id", "model", "status", "completion_tokens", "started_at"]
    # Hundreds of millions of rows: no COUNT(*) on the changelist, no filters that scan.
    show_full_result_count = False
    search_fields = ["=request_id"]


class InvoiceLineInline(admin.TabularInline[InvoiceLine, Invoice]):
    model = InvoiceLine
    extra = 0
    can_delete = False


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin[Invoice]):
    list_display = ["tenant", "month", "status", "total_usd", "finalized_at"]
    list_filter = ["status", "month"]
    inlines = [InvoiceLineInline]


admin.site.register([TenantDiscount, HourlyRollup, CostCenter, BudgetWebhook, BudgetAlert, Notice])
