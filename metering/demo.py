"""Demo data of the metering app: list prices for the seven demo models, each created once:
`make run` seeds on every start, and must not undo a price an operator has changed since."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from metering.models import PriceSheet
from metering.prices import publish_price_book

# USD per million tokens: input, cached input, output. Roughly what public APIs charge for
# models of these sizes; cached input at a quarter of input.
DEMO_PRICES: dict[str, tuple[str, str, str]] = {
    "llama-3.2-1b": ("0.03", "0.0075", "0.05"),
    "qwen2.5-7b": ("0.15", "0.0375", "0.30"),
    "llama-3.1-8b": ("0.18", "0.045", "0.36"),
    "mistral-7b-v0.3": ("0.15", "0.0375", "0.30"),
    "llama-3.1-70b": ("0.80", "0.20", "1.20"),
    "qwen2.5-72b": ("0.85", "0.2125", "1.25"),
    "llama-3.1-405b": ("3.00", "0.75", "4.50"),
}
TIER_MULTIPLIERS = {"interactive": "1.25", "standard": "1", "batch": "0.5"}
EFFECTIVE_FROM = datetime(2025, 1, 1, tzinfo=UTC)


def seed(details: dict) -> None:
    for model, (inp, cached, out) in DEMO_PRICES.items():
        PriceSheet.objects.get_or_create(
            model=model,
            adapter="",
            tenant=None,
            effective_from=EFFECTIVE_FROM,
            defaults={
                "input_usd_per_mtok": Decimal(inp),
                "cached_input_usd_per_mtok": Decimal(cached),
                "output_usd_per_mtok": Decimal(out),
                "tier_multipliers": TIER_MULTIPLIERS,
            },
        )
    try:
        publish_price_book()
    except Exception as error:  # Redis may not be up while seeding; beat republishes
        details.setdefault("extra", {})["Price book"] = f"not published yet ({error})"
