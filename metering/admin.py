"""Django admin registrations of the metering app. Usage, rollups and invoices are what was
served and billed, and price sheets are written through the console and the API, which
check them and publish the price book: read-only here (config/admin.py). Discounts, cost
centers and budget webhooks are written here."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from config.admin import ReadOnlyAdmin, ReadOnlyInline
from config.jobs import enqueue_on_commit
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
class PriceSheetAdmin(ReadOnlyAdmin):
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
class UsageEventAdmin(ReadOnlyAdmin):
    list_display = ["request_id", "tenant_id", "model", "status", "completion_tokens", "started_at"]
    # Hundreds of millions of rows: no COUNT(*) on the changelist, no filters that scan.
    show_full_result_count = False
    search_fields = ["=request_id"]


class InvoiceLineInline(ReadOnlyInline):
    model = InvoiceLine
    extra = 0
    can_delete = False


@admin.register(Invoice)
class InvoiceAdmin(ReadOnlyAdmin):
    list_display = ["tenant", "month", "status", "total_usd", "finalized_at"]
    list_filter = ["status", "month"]
    inlines = [InvoiceLineInline]


admin.site.register([HourlyRollup, BudgetAlert, Notice], ReadOnlyAdmin)
# Written here, and only here: who a tenant is to finance, and where its budget alerts go
# (each read when an invoice or an alert is made).
admin.site.register([CostCenter, BudgetWebhook])


@admin.register(TenantDiscount)
class TenantDiscountAdmin(admin.ModelAdmin[TenantDiscount]):
    """Written here; the gateways price with it from the price book, published on commit."""

    list_display = ["tenant", "percent", "effective_from"]

    def save_model(
        self, request: HttpRequest, obj: TenantDiscount, form: Any, change: bool
    ) -> None:
        super().save_model(request, obj, form, change)
        enqueue_on_commit("metering.publish_prices")

    def delete_model(self, request: HttpRequest, obj: TenantDiscount) -> None:
        super().delete_model(request, obj)
        enqueue_on_commit("metering.publish_prices")

    def delete_queryset(self, request: HttpRequest, queryset: Any) -> None:
        super().delete_queryset(request, queryset)
        enqueue_on_commit("metering.publish_prices")
