"""Prices: which price is in force for a request, and what the request is charged.

Pure: no Django, no I/O. The price sheets in PostgreSQL are turned into a `PriceBook` (see
`metering.prices.build_price_book`), published to Redis as JSON under `PRICE_BOOK_KEY` for
the gateway, and used by ingest to bill each event at the price in force when it started.

Money is integers. A sheet's USD per million tokens is held as micro-USD per million tokens
(USD x 1e6, exact for the six decimals PostgreSQL keeps); multipliers are basis points. A
charge is computed as one exact integer product and rounded half up to a whole micro-USD once
per request, so sums over any number of events never drift.

Resolution, most specific first: the tenant's own sheet for the model and adapter, the
tenant's sheet for the base model, the list sheet for the model and adapter, the list sheet for
the base model. Within each, the sheet with the latest `effective_from` not after the
request's start is in force. A tenant's discount (the latest in force) applies on top of
whichever sheet won, and the tier multiplier of that sheet scales it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

PRICE_BOOK_KEY = "metering:price_book"
MICROS = 1_000_000
TOKENS_PER_PRICE_UNIT = 1_000_000  # sheets quote USD per million tokens
BASIS_POINTS = 10_000


class PriceNotFound(LookupError):
    """No sheet prices this model for this tenant at this time."""


@dataclass(frozen=True, slots=True)
class SheetEntry:
    model: str
    adapter: str  # "" prices the base model (and any adapter without its own sheet)
    tenant_id: int | None  # None is the list price
    effective_from: float  # epoch seconds
    input_micros_per_m: int  # micro-USD per million uncached prompt tokens
    cached_input_micros_per_m: int
    output_micros_per_m: int
    tier_multipliers_bp: dict[str, int] = field(default_factory=dict)  # missing tier = 1.0


@dataclass(frozen=True, slots=True)
class DiscountEntry:
    tenant_id: int
    effective_from: float
    discount_bp: int  # 1_000 = 10 % off


@dataclass(frozen=True, slots=True)
class Price:
    input_micros_per_m: int
    cached_input_micros_per_m: int
    output_micros_per_m: int
    tier_multiplier_bp: int = BASIS_POINTS
    discount_bp: int = 0


def charge_usd_micros(
    price: Price, prompt_tokens: int, cached_prompt_tokens: int, completion_tokens: int
) -> int:
    """What a request is charged, in micro-USD. `prompt_tokens` includes the cached ones (as
    vLLM and OpenAI report them); those are billed at the cached rate instead. A stream cut
    short is billed for the completion tokens it actually delivered: pass those."""
    cached = min(max(0, cached_prompt_tokens), max(0, prompt_tokens))
    uncached = max(0, prompt_tokens) - cached
    base = (
        uncached * price.input_micros_per_m
        + cached * price.cached_input_micros_per_m
        + max(0, completion_tokens) * price.output_micros_per_m
    )
    numerator = base * price.tier_multiplier_bp * (BASIS_POINTS - price.discount_bp)
    denominator = TOKENS_PER_PRICE_UNIT * BASIS_POINTS * BASIS_POINTS
    return (numerator + denominator // 2) // denominator


class PriceBook:
    def __init__(
        self, sheets: Iterable[SheetEntry], discounts: Iterable[DiscountEntry] = ()
    ) -> None:
        self.sheets: list[SheetEntry] = sorted(sheets, key=lambda s: s.effective_from)
        self.discounts: list[DiscountEntry] = sorted(discounts, key=lambda d: d.effective_from)
        self._sheets: dict[tuple[int | None, str, str], list[SheetEntry]] = {}
        for sheet in self.sheets:
            self._sheets.setdefault((sheet.tenant_id, sheet.model, sheet.adapter), []).append(sheet)
        self._starts = {key: [s.effective_from for s in rows] for key, rows in self._sheets.items()}
        self._discounts: dict[int, list[DiscountEntry]] = {}
        for discount in self.discounts:
            self._discounts.setdefault(discount.tenant_id, []).append(discount)

    def sheet_for(
        self, model: str, adapter: str | None, tenant_id: int | None, at: float
    ) -> SheetEntry:
        adapter = adapter or ""
        candidates = [(tenant_id, model, adapter), (tenant_id, model, "")]
        candidates += [(None, model, adapter), (None, model, "")]
        for key in candidates:
            rows = self._sheets.get(key)
            if not rows:
                continue
            index = bisect_right(self._starts[key], at) - 1
            if index >= 0:
                return rows[index]
        raise PriceNotFound(f"no price for {model!r} adapter {adapter!r} at {at}")

    def discount_bp(self, tenant_id: int | None, at: float) -> int:
        if tenant_id is None:
            return 0
        in_force = 0
        for discount in self._discounts.get(tenant_id, ()):
            if discount.effective_from > at:
                break
            in_force = discount.discount_bp
        return in_force

    def price_for(
        self, model: str, adapter: str | None, tier: str, tenant_id: int | None, at: float
    ) -> Price:
        sheet = self.sheet_for(model, adapter, tenant_id, at)
        return Price(
            input_micros_per_m=sheet.input_micros_per_m,
            cached_input_micros_per_m=sheet.cached_input_micros_per_m,
            output_micros_per_m=sheet.output_micros_per_m,
            tier_multiplier_bp=sheet.tier_multipliers_bp.get(tier, BASIS_POINTS),
            discount_bp=self.discount_bp(tenant_id, at),
        )

    # --- transport to the gateway ---------------------------------------------------------

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "sheets": [_sheet_dict(s) for s in self.sheets],
                "discounts": [
                    {
                        "tenant_id": d.tenant_id,
                        "effective_from": d.effective_from,
                        "bp": d.discount_bp,
                    }
                    for d in self.discounts
                ],
            }
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> PriceBook:
        data: dict[str, Any] = orjson.loads(raw)
        sheets = [
            SheetEntry(
                model=s["model"],
                adapter=s["adapter"],
                tenant_id=s["tenant_id"],
                effective_from=s["effective_from"],
                input_micros_per_m=s["input"],
                cached_input_micros_per_m=s["cached_input"],
                output_micros_per_m=s["output"],
                tier_multipliers_bp=dict(s["tiers"]),
            )
            for s in data["sheets"]
        ]
        discounts = [
            DiscountEntry(d["tenant_id"], d["effective_from"], d["bp"]) for d in data["discounts"]
        ]
        return cls(sheets, discounts)


def _sheet_dict(s: SheetEntry) -> dict[str, Any]:
    return {
        "model": s.model,
        "adapter": s.adapter,
        "tenant_id": s.tenant_id,
        "effective_from": s.effective_from,
        "input": s.input_micros_per_m,
        "cached_input": s.cached_input_micros_per_m,
        "output": s.output_micros_per_m,
        "tiers": s.tier_multipliers_bp,
    }
