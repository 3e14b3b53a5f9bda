"""The metering app's writes (`do_*`) and tenant-scoped reads (`access_*`)."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any, cast

from django.core.exceptions import ValidationError
from django.db.models import Field, QuerySet

from config.ids import one_row
from config.jobs import enqueue_on_commit
from metering.invoices import do_build_invoice, do_close_month
from metering.models import HourlyRollup, Invoice, PriceSheet, ReplicaHour, UsageEvent
from registry.actions import visible_models_for_user
from tenants.actions import require_staff, tenants_for_user
from tenants.models import Tenant

__all__ = ["do_build_invoice", "do_close_month"]


def _publish_after_commit() -> None:
    enqueue_on_commit("metering.publish_prices")


PRICE_FIELDS = ("input_usd_per_mtok", "cached_input_usd_per_mtok", "output_usd_per_mtok")
# The columns hold 12 digits, 6 after the point.
MAX_PRICE = Decimal(1_000_000)


def check_price_sheet(fields: dict[str, Any]) -> dict[str, Any]:
    """Prices and tier multipliers that are numbers of at least zero, and names within their
    columns and written as the registry writes a model's and an adapter's; else a
    ValidationError naming the field (a negative price would pay tenants, a longer name would
    be a DataError, a 500). The API's serializer checks the same first."""
    for name in ("model", "adapter"):
        field = cast(Field[Any, Any], PriceSheet._meta.get_field(name))
        largest = field.max_length
        value = fields.get(name, "")
        if largest is not None and len(value) > largest:
            raise ValidationError({name: f"At most {largest} characters (this has {len(value)})."})
        try:
            field.run_validators(value)  # named as the registry names models and adapters
        except ValidationError as error:
            raise ValidationError({name: error.messages}) from None
    for name in PRICE_FIELDS:
        if name not in fields:
            continue
        price = _non_negative(fields[name])
        if price is None or price >= MAX_PRICE:
            raise ValidationError(
                {name: f"Enter a price from 0 to under {MAX_PRICE:,} USD per million tokens."}
            )
    for tier, multiplier in (fields.get("tier_multipliers") or {}).items():
        if _non_negative(multiplier) is None:
            raise ValidationError({"tier_multipliers": f"{tier}: enter a multiplier of 0 or more."})
    return fields


def check_known_model(user: Any, name: str) -> str:
    """A model of the registry. The console offers only those; the API also takes a price for
    a model before it is registered."""
    if not visible_models_for_user(user).filter(name=name).exists():
        raise ValidationError({"model": "Unknown model: choose one of the registry's models."})
    return name


def check_alert_percent(value: str) -> float:
    """An alert threshold in percent of the budget, above 0 and at most 100, as the quota's
    fraction."""
    percent = _non_negative(value)
    if percent is None or not 0 < percent <= 100:
        raise ValidationError({"soft_alert_percent": "Enter a percentage above 0 and at most 100."})
    return float(percent) / 100


def _non_negative(value: Any) -> Decimal | None:
    try:
        number = Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        return None
    return number if number.is_finite() and number >= 0 else None


def do_create_price_sheet(acting_user: Any, **fields: Any) -> PriceSheet:
    require_staff(acting_user)
    sheet = PriceSheet.objects.create(**check_price_sheet(fields))
    _publish_after_commit()
    return sheet


def do_update_price_sheet(sheet: PriceSheet, acting_user: Any, **changes: Any) -> PriceSheet:
    require_staff(acting_user)
    for name, value in check_price_sheet(changes).items():
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
    invoice: Invoice = one_row(access_invoices(user), invoice_id, "invoice")
    return invoice


def access_price_sheets(user: Any) -> QuerySet[PriceSheet]:
    """Staff see every sheet; a tenant member sees list prices and their own tenants' sheets."""
    if getattr(user, "is_staff", False):
        return PriceSheet.objects.all()
    mine = tenants_for_user(user)
    return PriceSheet.objects.filter(tenant__isnull=True) | PriceSheet.objects.filter(
        tenant__in=mine
    )
