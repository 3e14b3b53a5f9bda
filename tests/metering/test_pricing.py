"""The pure price book: which price is in force, and what a request is charged."""

from __future__ import annotations

from metering.pricing import DiscountEntry, PriceBook, SheetEntry, charge_usd_micros

DAY = 86_400.0


def list_sheet(model: str = "llama-3.1-8b", at: float = 0.0, out: int = 600_000) -> SheetEntry:
    # $0.20 in, $0.05 cached, $0.60 out per million tokens
    return SheetEntry(model, "", None, at, 200_000, 50_000, out, {"batch": 5_000})


def test_a_stream_cut_short_is_billed_for_the_tokens_it_delivered() -> None:
    price = PriceBook([list_sheet()]).price_for("llama-3.1-8b", None, "standard", 7, 10.0)
    # 1000 prompt tokens, the client went away after 37 of up to 500 completion tokens
    charged = charge_usd_micros(price, 1000, 0, 37)
    assert charged == round(1000 * 0.20 + 37 * 0.60)  # micro-USD: $/Mtok = µ$/token


def test_cached_prompt_tokens_are_billed_at_the_cached_rate() -> None:
    price = PriceBook([list_sheet()]).price_for("llama-3.1-8b", None, "standard", 7, 10.0)
    assert charge_usd_micros(price, 1000, 400, 0) == 600 * 0.20 + 400 * 0.05


def test_a_price_change_applies_from_its_effective_date_only() -> None:
    book = PriceBook([list_sheet(at=0.0, out=600_000), list_sheet(at=15 * DAY, out=900_000)])
    before = book.price_for("llama-3.1-8b", None, "standard", 7, 15 * DAY - 1)
    after = book.price_for("llama-3.1-8b", None, "standard", 7, 15 * DAY)
    assert (before.output_micros_per_m, after.output_micros_per_m) == (600_000, 900_000)


def test_a_tenants_own_sheet_overrides_the_list_price_for_that_tenant_only() -> None:
    own = SheetEntry("llama-3.1-8b", "", 7, 0.0, 100_000, 10_000, 300_000)
    book = PriceBook([list_sheet(), own])
    assert book.price_for("llama-3.1-8b", None, "standard", 7, 1.0).output_micros_per_m == 300_000
    assert book.price_for("llama-3.1-8b", None, "standard", 8, 1.0).output_micros_per_m == 600_000


def test_an_adapter_without_its_own_sheet_is_billed_at_the_base_models_price() -> None:
    book = PriceBook([list_sheet()])
    price = book.price_for("llama-3.1-8b", "sql-lora", "standard", 7, 1.0)
    assert price.output_micros_per_m == 600_000


def test_tier_multiplier_and_discount_both_scale_the_charge() -> None:
    book = PriceBook([list_sheet()], [DiscountEntry(7, 0.0, 1_000)])  # 10 % off
    price = book.price_for("llama-3.1-8b", None, "batch", 7, 1.0)  # batch at half price
    assert charge_usd_micros(price, 0, 0, 1_000_000) == 600_000 * 0.5 * 0.9


def test_the_book_survives_its_trip_through_json() -> None:
    book = PriceBook([list_sheet(), list_sheet(at=DAY, out=1)], [DiscountEntry(7, 5.0, 250)])
    again = PriceBook.from_json(book.to_json())
    for at in (1.0, DAY + 1):
        assert again.price_for("llama-3.1-8b", "", "batch", 7, at) == book.price_for(
            "llama-3.1-8b", "", "batch", 7, at
        )
