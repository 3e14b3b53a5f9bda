"""`make run` seeds the demo on every start: a second seed creates what is missing and never
puts back a quota, budget or price an operator changed."""

from __future__ import annotations

from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from pytest_django import Settings

from metering.demo import DEMO_PRICES
from metering.models import PriceSheet
from tenants.actions import do_update_quota
from tenants.demo import DEMO_QUOTA
from tenants.models import Quota

pytestmark = pytest.mark.django_db


@pytest.fixture
def seeded(gpu_classes: None, tmp_path: Path, settings: Settings, redis_client: Any) -> None:
    settings.PLATFORM_VAR_DIR = tmp_path
    call_command("seed_demo", stdout=StringIO())


def seed_again() -> None:
    call_command("seed_demo", stdout=StringIO())


def demo_sheet(model: str = "llama-3.1-8b") -> PriceSheet:
    return PriceSheet.objects.get(model=model, adapter="", tenant=None)


def test_the_first_seed_gives_the_demo_tenants_the_demo_quota(seeded: None) -> None:
    quota = Quota.objects.get(tenant__slug="acme")
    assert {name: getattr(quota, name) for name in DEMO_QUOTA} == DEMO_QUOTA


def test_a_quota_an_operator_changed_survives_the_next_seed(seeded: None) -> None:
    do_update_quota(
        Quota.objects.get(tenant__slug="acme"),
        tokens_per_minute=1234,
        requests_per_minute=7,
        concurrent_streams=2,
    )
    seed_again()
    quota = Quota.objects.get(tenant__slug="acme")
    assert (quota.tokens_per_minute, quota.requests_per_minute, quota.concurrent_streams) == (
        1234,
        7,
        2,
    )
    # the other demo tenant keeps the demo's quota
    assert Quota.objects.get(tenant__slug="globex").tokens_per_minute == 500_000


def test_a_budget_an_operator_changed_survives_the_next_seed(seeded: None) -> None:
    do_update_quota(
        Quota.objects.get(tenant__slug="globex"),
        monthly_token_budget=None,
        monthly_spend_budget_usd=Decimal("25.00"),
        hard_budget=False,
    )
    seed_again()
    quota = Quota.objects.get(tenant__slug="globex")
    assert (quota.monthly_token_budget, quota.monthly_spend_budget_usd, quota.hard_budget) == (
        None,
        Decimal("25.00"),
        False,
    )


def test_a_price_an_operator_changed_survives_the_next_seed(seeded: None) -> None:
    sheet = demo_sheet()
    sheet.output_usd_per_mtok = Decimal("9.99")
    sheet.save()
    seed_again()
    assert demo_sheet().output_usd_per_mtok == Decimal("9.99")
    assert PriceSheet.objects.filter(tenant=None, adapter="").count() == len(DEMO_PRICES)


def test_a_demo_price_an_operator_deleted_is_created_again(seeded: None) -> None:
    demo_sheet("qwen2.5-7b").delete()
    seed_again()
    assert demo_sheet("qwen2.5-7b").output_usd_per_mtok == Decimal(DEMO_PRICES["qwen2.5-7b"][2])
