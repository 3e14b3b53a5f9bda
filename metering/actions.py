"""The metering app's writes (`do_*`) and tenant-scoped reads (`access_*`)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.http import Http404

from config.jobs import enqueue_on_commit
from metering.invoices import do_build_invoice, do_close_month
from metering.models import HourlyRollup, Invoice, PriceSheet, ReplicaHour, UsageEvent
from tenants.actions import require_staff, tenants_for_user
from tenants.models import Tenant

__all__ = ["do_build_invoice", "do_close_month"]


def _publish_after_commit() -> None:
    enqueue_on_commit("metering.publish_prices")


def do_create_price_sheet(acting_user: Any, **fields: Any) -> PriceSheet:
    require_staff(acting_user)
    sheet = PriceSheet.objects.create(**fields)
    _publish_after_commit()
    return sheet


def do_update_price_sheet(sheet: PriceSheet, acting_user: Any, **changes: Any) -> PriceSheet:
    require_staff(acting_user)
    for name, value in changes.items():
        setattr(sheet, name, value)
    sheet.save()
    _publish_after_commit()
    return sheet


def do_delete_price_sheet(sheet: PriceSheet, acting_user: Any) -> None:
    require_staff(acting_user)
    sheet.delete()
    _publish_after_commit()


def tenant_ids_for_user(user: Any) -> QuerySet[Tenant, int]:
    return tenants_for_user(user).values_list("pk", flat=True)


def access_usage(user: Any) -> QuerySet[UsageEvent]:
    if getattr(user, "is_staff", False):
        return UsageEvent.objects.all()
    return UsageEvent.objects.filter(tenant_id__in=list(tenant_ids_for_user(user)))


def access_rollups(user: Any) -> QuerySet[HourlyRollup]:
    if getattr(user, "is_staff", False):
        return HourlyRollup.objects.all()
    return HourlyRollup.objects.filter(tenant_id__in=list(tenant_ids_for_user(user)))


def access_replica_hours(user: Any) -> QuerySet[ReplicaHour]:
    """The GPU-time ledger: a fleet-wide cost no tenant's member may read."""
    if getattr(user, "is_staff", False):
        return ReplicaHour.objects.all()
    return ReplicaHour.objects.none()


def access_invoices(user: Any) -> QuerySet[Invoice]:
    return Invoice.objects.filter(tenant__in=tenants_for_user(user)).select_related("tenant")


def access_invoice(user: Any, invoice_id: int | str) -> Invoice:
    invoice = access_invoices(user).filter(pk=_as_id(invoice_id)).first()
    if invoice is None:
        raise Http404("No such invoice.")
    return invoice


def access_price_sheets(user: Any) -> QuerySet[PriceSheet]:
    """Staff see every sheet; a tenant member sees list prices and their own tenants' sheets."""
    if getattr(user, "is_staff", False):
        return PriceSheet.objects.all()
    mine = tenants_for_user(user)
    return PriceSheet.objects.filter(tenant__isnull=True) | PriceSheet.objects.filter(
        tenant__in=mine
    )


def _as_id(value: int | str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise Http404("No such row.") from None
