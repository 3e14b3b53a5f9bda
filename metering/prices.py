"""Price sheets in PostgreSQL turned into the pure `PriceBook`, and published to Redis."""

from __future__ import annotations

from decimal import Decimal

import redis as redis_lib

from config.redis import redis_client
from metering.models import PriceSheet, TenantDiscount
from metering.pricing import BASIS_POINTS, PRICE_BOOK_KEY, DiscountEntry, PriceBook, SheetEntry

_MICROS = Decimal(1_000_000)


def usd_to_micros(usd: Decimal | str | float) -> int:
    return int((Decimal(str(usd)) * _MICROS).to_integral_value())


def to_basis_points(fraction: Decimal | str | float) -> int:
    return int((Decimal(str(fraction)) * BASIS_POINTS).to_integral_value())


def sheet_entry(sheet: PriceSheet) -> SheetEntry:
    return SheetEntry(
        model=sheet.model,
        adapter=sheet.adapter,
        tenant_id=sheet.tenant_id,
        effective_from=sheet.effective_from.timestamp(),
        input_micros_per_m=usd_to_micros(sheet.input_usd_per_mtok),
        cached_input_micros_per_m=usd_to_micros(sheet.cached_input_usd_per_mtok),
        output_micros_per_m=usd_to_micros(sheet.output_usd_per_mtok),
        tier_multipliers_bp={
            tier: to_basis_points(value) for tier, value in (sheet.tier_multipliers or {}).items()
        },
    )


def build_price_book() -> PriceBook:
    sheets = [sheet_entry(s) for s in PriceSheet.objects.all()]
    discounts = [
        DiscountEntry(d.tenant_id, d.effective_from.timestamp(), to_basis_points(d.percent / 100))
        for d in TenantDiscount.objects.all()
    ]
    return PriceBook(sheets, discounts)


def publish_price_book(client: redis_lib.Redis | None = None) -> PriceBook:
    """Write the whole book to Redis for the gateway (at start and after every change)."""
    book = build_price_book()
    (client or redis_client(worker=True)).set(PRICE_BOOK_KEY, book.to_json())
    return book
