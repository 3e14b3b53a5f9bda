"""Invoices: billed at the prices in force, closed once, exported."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metering import ingest
from metering.invoices import (
    chargeback_rows,
    do_build_invoice,
    do_close_month,
    invoice_as_csv,
    invoice_as_dict,
)
from metering.models import CostCenter, Invoice, PriceSheet, UsageEvent
from metering.usage import add_usage_event
from tenants.models import Tenant
from tests.metering.helpers import event

JANUARY = date(2026, 1, 1)
JAN_START = datetime(2026, 1, 1, tzinfo=UTC)
MODELS = ("llama-3.1-8b", "qwen2.5-72b")
TIERS = {"interactive": Decimal("1.25"), "standard": Decimal("1"), "batch": Decimal("0.5")}

# (model, hours into January, input, cached input and output USD per million tokens)
PriceChange = tuple[str, int, Decimal, Decimal, Decimal]
# (model, seconds into January, tier, prompt, cached and completion tokens, the gateway's charge)
DrawnEvent = tuple[str, int, str, int, int, int, int]

prices = st.decimals(Decimal("0.01"), Decimal("20"), places=6)
price_changes = st.lists(
    st.tuples(st.sampled_from(MODELS), st.integers(0, 30 * 24), prices, prices, prices),
    min_size=1,
    max_size=6,
)
events = st.lists(
    st.tuples(
        st.sampled_from(MODELS),
        st.integers(0, 31 * 24 * 3600 - 2),
        st.sampled_from(sorted(TIERS)),
        st.integers(0, 50_000),
        st.integers(0, 50_000),
        st.integers(0, 8_000),
        st.integers(0, 10**6),  # what a stale gateway book charged: ingest re-prices it
    ),
    max_size=40,
)


def _in_force(changes: list[PriceChange], model: str, at: datetime) -> list[Decimal] | None:
    chosen = None
    for m, hours, *rates in sorted(changes, key=lambda c: c[1]):
        if m == model and JAN_START + timedelta(hours=hours) <= at:
            chosen = rates
    # Two changes at the same hour: the later one in the list was stored last (an update).
    return chosen


def _oracle_micros(rates: list[Decimal], tier: str, prompt: int, cached: int, out: int) -> int:
    cached = min(cached, prompt)
    usd = (rates[0] * (prompt - cached) + rates[1] * cached + rates[2] * out) / 1_000_000
    return int((usd * TIERS[tier] * 1_000_000).quantize(Decimal(1), rounding=ROUND_HALF_UP))


@pytest.mark.django_db
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(changes=price_changes, drawn=events)
def test_an_invoice_totals_its_events_at_the_prices_in_force_when_they_happened(
    redis_client: redis.Redis, changes: list[PriceChange], drawn: list[DrawnEvent]
) -> None:
    redis_client.flushdb()
    UsageEvent.objects.all().delete()
    Invoice.objects.all().delete()
    PriceSheet.objects.all().delete()
    tenant, _ = Tenant.objects.get_or_create(slug="acme", defaults={"name": "Acme"})
    stored: dict[tuple[str, int], PriceChange] = {}
    for model, hours, inp, cached_rate, out_rate in changes:
        stored[(model, hours)] = (model, hours, inp, cached_rate, out_rate)
        PriceSheet.objects.update_or_create(
            model=model,
            adapter="",
            tenant=None,
            effective_from=JAN_START + timedelta(hours=hours),
            defaults={
                "input_usd_per_mtok": inp,
                "cached_input_usd_per_mtok": cached_rate,
                "output_usd_per_mtok": out_rate,
                "tier_multipliers": {t: str(m) for t, m in TIERS.items()},
            },
        )
    pipe = redis_client.pipeline(transaction=False)
    want = 0
    for model, second, tier, prompt, cached, out, gateway_charge in drawn:
        at = JAN_START + timedelta(seconds=second)
        rates = _in_force(list(stored.values()), model, at)
        if rates is None:
            continue  # no price in force yet: such a request would not have been served
        want += _oracle_micros(rates, tier, prompt, cached, out)
        add_usage_event(
            pipe,
            event(
                tenant.pk,
                model=model,
                priority=tier,
                prompt_tokens=prompt,
                cached_prompt_tokens=cached,
                completion_tokens=out,
                started_at=at.timestamp(),
                ended_at=at.timestamp() + 1,
                price_charged_usd_micros=gateway_charge,
            ),
        )
    pipe.execute()
    ingest.Consumer(redis_client, "c1").drain(max_seconds=30)
    invoice = do_close_month(tenant, JANUARY)
    assert invoice.total_usd_micros == want
    assert invoice.total_usd == Decimal(want) / 1_000_000


@pytest.fixture
def acme(db: None) -> Tenant:
    return Tenant.objects.create(slug="acme", name="Acme")


def _store(tenant: Tenant, **fields: object) -> None:
    e = event(tenant.pk, **fields)
    row = {k: getattr(e, k) for k in ingest.COLUMNS}
    row["started_at"] = datetime.fromtimestamp(e.started_at, UTC)
    row["ended_at"] = datetime.fromtimestamp(e.ended_at, UTC)
    UsageEvent.objects.create(**row)


def test_closing_a_month_twice_changes_nothing(acme: Tenant) -> None:
    _store(acme, price_charged_usd_micros=1_500)
    first = do_close_month(acme, JANUARY)
    _store(acme, price_charged_usd_micros=9_999)  # a late event after the close
    second = do_close_month(acme, JANUARY)
    assert (second.pk, second.total_usd_micros, second.finalized_at) == (
        first.pk,
        1_500,
        first.finalized_at,
    )


def test_a_draft_follows_new_events_until_it_is_finalized(acme: Tenant) -> None:
    _store(acme, price_charged_usd_micros=1_000)
    do_build_invoice(acme, JANUARY, finalize=False)
    _store(acme, price_charged_usd_micros=2_000)
    draft = do_build_invoice(acme, JANUARY, finalize=False)
    assert (draft.status, draft.total_usd_micros) == (Invoice.Status.DRAFT, 3_000)


def test_an_invoice_has_a_line_per_model_in_its_exports(acme: Tenant) -> None:
    _store(acme, model="llama-3.1-8b", price_charged_usd_micros=1_000)
    _store(acme, model="qwen2.5-72b", price_charged_usd_micros=4_000)
    invoice = do_close_month(acme, JANUARY)
    rows = list(csv.DictReader(io.StringIO(invoice_as_csv(invoice))))
    as_json = json.loads(json.dumps(invoice_as_dict(invoice)))
    assert [(r["model"], r["amount_usd"]) for r in rows] == [
        ("llama-3.1-8b", "0.001000"),
        ("qwen2.5-72b", "0.004000"),
    ]
    assert [line["model"] for line in as_json["lines"]] == ["llama-3.1-8b", "qwen2.5-72b"]


def test_chargeback_groups_invoices_by_the_teams_cost_center(acme: Tenant) -> None:
    globex = Tenant.objects.create(slug="globex", name="Globex")
    CostCenter.objects.create(tenant=acme, team="Search", code="CC-100")
    for tenant in (acme, globex):
        _store(tenant, price_charged_usd_micros=2_000_000)
        do_close_month(tenant, JANUARY)
    rows = chargeback_rows(JANUARY)
    assert [(r["cost_center"], r["team"], r["total_usd"]) for r in rows] == [
        ("CC-100", "Search", "2.000000"),
        ("globex", "Globex", "2.000000"),
    ]


def test_one_tenants_failing_invoice_leaves_the_others_invoiced(
    acme: Tenant, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The beat's refresh goes on past a tenant whose invoice raises (config.loops)."""
    from config.loops import loop_failures
    from metering import invoices, tasks

    broken = Tenant.objects.create(slug="broken", name="Broken")
    later = Tenant.objects.create(slug="later", name="Later")  # walked after the broken one
    real = invoices.do_build_invoice

    def build(tenant: Tenant, month: date, *, finalize: bool) -> Invoice:
        if tenant.pk == broken.pk:
            raise ArithmeticError("a price sheet of NaN")
        return real(tenant, month, finalize=finalize)

    monkeypatch.setattr(invoices, "do_build_invoice", build)
    tasks.refresh_invoices()
    assert Invoice.objects.filter(tenant=acme).count() == 2  # this month's and last month's
    assert Invoice.objects.filter(tenant=later).count() == 2
    assert not Invoice.objects.filter(tenant=broken).exists()
    (failure,) = loop_failures(redis_client, "tenant")[broken.pk]
    assert (failure.loop, failure.error) == ("invoices", "ArithmeticError: a price sheet of NaN")
