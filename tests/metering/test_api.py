"""The metering REST API: usage, rollups, invoices, price sheets, margin; tenant isolation."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from django.urls import URLPattern, resolve
from rest_framework.test import APIClient

from config.jobs import Enqueue
from metering.api import urls as metering_urls
from metering.invoices import do_build_invoice
from metering.models import (
    CostCenter,
    HourlyRollup,
    Invoice,
    PriceSheet,
    ReplicaHour,
    micros_to_usd,
)
from metering.pricing import PRICE_BOOK_KEY
from metering.rollups import empty_buckets
from metering.tasks import publish_prices
from registry.models import Visibility
from tenants.actions import do_create_api_key
from tenants.models import Tenant
from tests.metering.helpers import stored as store
from tests.registry.conftest import make_model
from tests.tenants.conftest import make_tenant, user

JAN = datetime(2026, 1, 1, tzinfo=UTC)
JANUARY = JAN.date()


@pytest.fixture
def acme(db: None, redis_client: Any) -> Tenant:
    return make_tenant("acme")


@pytest.fixture
def globex(db: None, redis_client: Any) -> Tenant:
    return make_tenant("globex")


@pytest.fixture
def staff(db: None) -> Any:
    return get_user_model().objects.create_user("ops", is_staff=True)


@pytest.fixture
def run_on_commit(django_capture_on_commit_callbacks: Callable[..., Any]) -> Any:
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        yield callbacks


def session(who: Any) -> APIClient:
    client = APIClient()
    client.force_login(user(who) if isinstance(who, str) else who)
    return client


def bearer(tenant: Tenant, scopes: list[str]) -> APIClient:
    _, raw = do_create_api_key(tenant, "automation", user(f"{tenant.slug}-owner"), scopes)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def rollup(tenant: Tenant, hour: datetime, **fields: Any) -> HourlyRollup:
    values: dict[str, Any] = {
        "model": "llama-3.1-8b",
        "adapter": "",
        "pool": "h100-east",
        "tier": "standard",
        "requests": 10,
        "errors": 1,
        "prompt_tokens": 1_000,
        "cached_prompt_tokens": 100,
        "completion_tokens": 500,
        "gpu_seconds": 36.0,
        "cost_to_serve_usd_micros": 40_000,
        "revenue_usd_micros": 70_000,
        "ttft_buckets": empty_buckets(),
        "total_buckets": empty_buckets(),
    }
    values.update(fields)
    return HourlyRollup.objects.create(hour=hour, tenant_id=tenant.pk, **values)


# ------------------------------------------------------------------------------- usage


def test_usage_totals_equal_the_events_inserted(acme: Tenant) -> None:
    events = [
        store(acme, JAN + timedelta(hours=5 * i), price_charged_usd_micros=1_000 + 37 * i)
        for i in range(30)
    ]
    body = session("acme-viewer").get(
        "/api/v1/tenants/acme/usage/", {"start": "2026-01-01", "end": "2026-02-01"}
    )
    assert body.status_code == 200
    totals = body.json()["totals"]
    assert totals["requests"] == len(events)
    assert totals["prompt_tokens"] == sum(e.prompt_tokens for e in events)
    assert totals["completion_tokens"] == sum(e.completion_tokens for e in events)
    assert Decimal(totals["spend_usd"]) == micros_to_usd(
        sum(e.price_charged_usd_micros for e in events)
    )


def test_usage_by_day_puts_each_event_in_its_day(acme: Tenant) -> None:
    events = [store(acme, JAN + timedelta(hours=7 * i)) for i in range(20)]
    body = (
        session("acme-viewer")
        .get(
            "/api/v1/tenants/acme/usage/",
            {"start": "2026-01-01", "end": "2026-01-10", "granularity": "day"},
        )
        .json()
    )
    want: dict[str, int] = {}
    for e in events:
        day = e.started_at.replace(hour=0).isoformat().replace("+00:00", "Z")
        want[day] = want.get(day, 0) + e.completion_tokens
    assert {b["period"]: b["completion_tokens"] for b in body["buckets"]} == want


def test_usage_by_month_sums_a_month_into_one_bucket(acme: Tenant) -> None:
    jan = [store(acme, JAN + timedelta(days=d)) for d in (0, 10, 30)]
    feb = [store(acme, JAN + timedelta(days=d)) for d in (31, 40)]
    body = (
        session("acme-viewer")
        .get(
            "/api/v1/tenants/acme/usage/",
            {"start": "2026-01-01", "end": "2026-03-01", "granularity": "month"},
        )
        .json()
    )
    assert [b["requests"] for b in body["buckets"]] == [len(jan), len(feb)]


def test_usage_filters_by_model_and_key(acme: Tenant) -> None:
    store(acme, JAN, model="qwen2.5-72b", key_id=7)
    store(acme, JAN, model="llama-3.1-8b", key_id=7)
    wanted = store(acme, JAN, model="llama-3.1-8b", key_id=9)
    body = (
        session("acme-viewer")
        .get(
            "/api/v1/tenants/acme/usage/",
            {"start": "2026-01-01", "end": "2026-01-02", "model": "llama-3.1-8b", "key": 9},
        )
        .json()
    )
    assert (body["totals"]["requests"], body["totals"]["prompt_tokens"]) == (
        1,
        wanted.prompt_tokens,
    )


def test_usage_counts_errors_by_status(acme: Tenant) -> None:
    statuses = ["ok", "error", "upstream_failed", "client_cancelled", "ok"]
    for status in statuses:
        store(acme, JAN, status=status)
    body = (
        session("acme-viewer")
        .get("/api/v1/tenants/acme/usage/", {"start": "2026-01-01", "end": "2026-01-02"})
        .json()
    )
    assert body["totals"]["errors"] == sum(s in ("error", "upstream_failed") for s in statuses)


def test_usage_leaves_out_other_tenants_events(acme: Tenant, globex: Tenant) -> None:
    store(acme, JAN)
    store(globex, JAN)
    store(globex, JAN)
    body = (
        session("acme-viewer")
        .get("/api/v1/tenants/acme/usage/", {"start": "2026-01-01", "end": "2026-01-02"})
        .json()
    )
    assert body["totals"]["requests"] == 1


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"start": "yesterday"}, "start"),
        ({"end": "2026-02-30"}, "end"),
        ({"start": "2026-01-02", "end": "2026-01-01"}, "end"),
        ({"granularity": "week"}, "granularity"),
        ({"key": "abc"}, "key"),
        ({"start": "2020-01-01", "end": "2026-01-01", "granularity": "hour"}, "granularity"),
    ],
)
def test_bad_usage_parameters_are_a_400_naming_the_parameter(
    acme: Tenant, params: dict[str, str], named: str
) -> None:
    response = session("acme-viewer").get("/api/v1/tenants/acme/usage/", params)
    assert response.status_code == 400
    assert named in response.json()


def test_bad_dates_on_every_filtered_list_are_a_400(acme: Tenant, staff: Any) -> None:
    urls = [
        "/api/v1/tenants/acme/usage/events/",
        "/api/v1/tenants/acme/rollups/",
        "/api/v1/rollups/",
        "/api/v1/margin/",
    ]
    codes = {url: session(staff).get(url, {"start": "2026-13-01"}) for url in urls}
    assert {url: (r.status_code, list(r.json())) for url, r in codes.items()} == {
        url: (400, ["start"]) for url in urls
    }


def test_usage_events_page_newest_first_through_every_event(acme: Tenant) -> None:
    events = [store(acme, JAN + timedelta(minutes=i)) for i in range(25)]
    client = session("acme-viewer")
    url: str | None = "/api/v1/tenants/acme/usage/events/?start=2026-01-01&end=2026-01-02&limit=10"
    seen: list[str] = []
    while url:
        page = client.get(url).json()
        seen += [row["request_id"] for row in page["results"]]
        url = page["next"]
    newest_first = sorted(events, key=lambda e: e.started_at, reverse=True)
    assert seen == [e.request_id for e in newest_first]


def test_a_usage_event_carries_the_trace_id_of_its_request(acme: Tenant) -> None:
    store(acme, JAN, trace_id="4bf92f3577b34da6a3ce929d0e0e4736")
    url = "/api/v1/tenants/acme/usage/events/?start=2026-01-01&end=2026-01-02"

    [row] = session("acme-viewer").get(url).json()["results"]

    assert row["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_a_usage_event_says_its_tpot_and_the_clock_it_missed(acme: Tenant) -> None:
    # Interactive: a first token in 0.4 s, then 9 more tokens in 0.9 s (100 ms each, over 50).
    store(acme, JAN, priority="interactive", ttft_ms=400.0, completion_tokens=10, total_ms=1300.0)
    url = "/api/v1/tenants/acme/usage/events/?start=2026-01-01&end=2026-01-02"

    [row] = session("acme-viewer").get(url).json()["results"]

    assert (row["tpot_ms"], row["slo_outcome"]) == (pytest.approx(100.0), "tpot")


def test_usage_events_show_cost_to_serve_to_staff_only(acme: Tenant, staff: Any) -> None:
    store(acme, JAN, cost_to_serve_usd_micros=1234, gpu_seconds=0.5)
    url = "/api/v1/tenants/acme/usage/events/?start=2026-01-01&end=2026-01-02"
    [as_tenant] = session("acme-owner").get(url).json()["results"]
    [as_staff] = session(staff).get(url).json()["results"]
    assert "cost_to_serve_usd" not in as_tenant and "gpu_seconds" not in as_tenant
    assert Decimal(as_staff["cost_to_serve_usd"]) == micros_to_usd(1234)


def test_a_disaggregated_request_shows_its_prefill_pool_and_its_replica_to_staff_only(
    acme: Tenant, staff: Any
) -> None:
    store(acme, JAN, prefill_replica_id="r-prefill-1", prefill_pool="l40s-prefill")
    url = "/api/v1/tenants/acme/usage/events/?start=2026-01-01&end=2026-01-02"
    [as_tenant] = session("acme-owner").get(url).json()["results"]
    [as_staff] = session(staff).get(url).json()["results"]
    assert as_tenant["prefill_pool"] == as_staff["prefill_pool"] == "l40s-prefill"
    assert "prefill_replica_id" not in as_tenant
    assert as_staff["prefill_replica_id"] == "r-prefill-1"


def test_a_read_usage_key_reads_its_tenants_usage(acme: Tenant) -> None:
    stored = store(acme, JAN)
    response = bearer(acme, ["read_usage"]).get(
        "/api/v1/tenants/acme/usage/", {"start": "2026-01-01", "end": "2026-01-02"}
    )
    assert response.json()["totals"]["prompt_tokens"] == stored.prompt_tokens


def test_an_inference_key_is_refused(acme: Tenant) -> None:
    response = bearer(acme, ["inference"]).get("/api/v1/tenants/acme/usage/")
    assert response.status_code == 403


# ------------------------------------------------------------------------------ rollups


def test_a_tenant_lists_its_own_rollups_filtered_by_model(acme: Tenant, globex: Tenant) -> None:
    mine = rollup(acme, JAN, model="qwen2.5-72b")
    rollup(acme, JAN, model="llama-3.1-8b")
    rollup(globex, JAN, model="qwen2.5-72b")
    body = (
        session("acme-viewer")
        .get(
            "/api/v1/tenants/acme/rollups/",
            {"start": "2026-01-01", "end": "2026-01-02", "model": "qwen2.5-72b"},
        )
        .json()
    )
    assert [row["id"] for row in body["results"]] == [mine.pk]
    assert "cost_to_serve_usd" not in body["results"][0]


def test_rollups_report_percentiles_from_their_buckets(acme: Tenant) -> None:
    buckets = empty_buckets()
    buckets[3], buckets[9] = 60, 40  # [100, 200) ms and [1500, 2000) ms
    rollup(acme, JAN, total_buckets=buckets)
    [row] = (
        session("acme-viewer")
        .get("/api/v1/tenants/acme/rollups/", {"start": "2026-01-01", "end": "2026-01-02"})
        .json()["results"]
    )
    assert (row["total_p50_ms"], row["total_p95_ms"]) == (200, 2000)


def test_staff_list_every_tenants_rollups_or_one_tenants(
    acme: Tenant, globex: Tenant, staff: Any
) -> None:
    ours = [rollup(acme, JAN), rollup(globex, JAN)]
    client = session(staff)
    params = {"start": "2026-01-01", "end": "2026-01-02"}
    every = client.get("/api/v1/rollups/", params).json()
    only_globex = client.get("/api/v1/rollups/", {**params, "tenant": "globex"}).json()
    assert sorted(row["id"] for row in every["results"]) == sorted(r.pk for r in ours)
    assert [row["tenant_id"] for row in only_globex["results"]] == [globex.pk]


def test_staff_filtering_rollups_by_an_unknown_tenant_is_a_400(staff: Any) -> None:
    response = session(staff).get("/api/v1/rollups/", {"tenant": "nope"})
    assert response.status_code == 400
    assert "tenant" in response.json()


# ----------------------------------------------------------------------------- invoices


@pytest.fixture
def acme_invoice(acme: Tenant) -> Invoice:
    store(acme, JAN, model="llama-3.1-8b", price_charged_usd_micros=1_500_000)
    store(acme, JAN, model="llama-3.1-8b", price_charged_usd_micros=250_000)
    store(acme, JAN, model="qwen2.5-72b", price_charged_usd_micros=3_000_001)
    return do_build_invoice(acme, JANUARY, finalize=False)


def test_a_tenant_lists_its_invoices_with_their_lines(acme_invoice: Invoice) -> None:
    body = session("acme-viewer").get("/api/v1/tenants/acme/invoices/").json()
    [invoice] = body["results"]
    assert (invoice["month"], invoice["status"]) == ("2026-01", "draft")
    assert Decimal(invoice["total_usd"]) == acme_invoice.total_usd
    assert sum(Decimal(line["amount_usd"]) for line in invoice["lines"]) == acme_invoice.total_usd


def test_listing_invoices_costs_the_same_queries_for_one_or_many_months(
    acme_invoice: Invoice, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    client = session("acme-viewer")
    client.get("/api/v1/tenants/acme/invoices/")  # warm the session and the content types
    with django_assert_max_num_queries(8) as one_month:
        client.get("/api/v1/tenants/acme/invoices/")
    for month in (2, 3, 4, 5):
        store(acme_invoice.tenant, JAN.replace(month=month))
        do_build_invoice(acme_invoice.tenant, JAN.replace(month=month).date(), finalize=False)
    with django_assert_max_num_queries(len(one_month.captured_queries)):
        body = client.get("/api/v1/tenants/acme/invoices/").json()
    assert body["count"] == 5


def test_an_invoice_detail_has_a_line_per_model(acme_invoice: Invoice) -> None:
    body = session("acme-viewer").get(f"/api/v1/tenants/acme/invoices/{acme_invoice.pk}/").json()
    assert {line["model"]: line["requests"] for line in body["lines"]} == {
        "llama-3.1-8b": 2,
        "qwen2.5-72b": 1,
    }


def test_the_csv_export_has_a_row_per_line_with_its_amount(acme_invoice: Invoice) -> None:
    response = session("acme-viewer").get(
        f"/api/v1/tenants/acme/invoices/{acme_invoice.pk}/export.csv"
    )
    assert response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert {row["model"]: Decimal(row["amount_usd"]) for row in rows} == {
        line.model: line.amount_usd for line in acme_invoice.lines.all()
    }
    assert {(row["tenant"], row["month"]) for row in rows} == {("acme", "2026-01")}


def test_the_json_export_totals_its_lines(acme_invoice: Invoice) -> None:
    response = session("acme-viewer").get(
        f"/api/v1/tenants/acme/invoices/{acme_invoice.pk}/export.json"
    )
    body = json.loads(response.content)
    assert Decimal(body["total_usd"]) == sum(Decimal(line["amount_usd"]) for line in body["lines"])
    assert Decimal(body["total_usd"]) == acme_invoice.total_usd


def test_staff_close_a_month_once_and_a_second_close_changes_nothing(
    acme_invoice: Invoice, staff: Any
) -> None:
    client = session(staff)
    first = client.post(
        "/api/v1/invoices/close/", {"tenant": "acme", "month": "2026-01"}, format="json"
    )
    store(acme_invoice.tenant, JAN, price_charged_usd_micros=9_999_999)  # arrives late
    second = client.post(
        "/api/v1/invoices/close/", {"tenant": "acme", "month": "2026-01"}, format="json"
    )
    assert first.status_code == second.status_code == 200
    assert first.json()["status"] == "finalized"
    assert second.json() == first.json()
    assert Decimal(second.json()["total_usd"]) == acme_invoice.total_usd


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"tenant": "acme", "month": "January"}, "month"),
        ({"tenant": "nope", "month": "2026-01"}, "tenant"),
    ],
)
def test_closing_with_bad_input_is_a_400_naming_the_field(
    acme: Tenant, staff: Any, body: dict[str, str], named: str
) -> None:
    response = session(staff).post("/api/v1/invoices/close/", body, format="json")
    assert response.status_code == 400
    assert named in response.json()
    assert not Invoice.objects.exists()


def test_the_chargeback_csv_has_a_row_per_team(acme: Tenant, globex: Tenant, staff: Any) -> None:
    CostCenter.objects.create(tenant=acme, team="Search", code="CC-100")
    store(acme, JAN, price_charged_usd_micros=2_000_000)
    store(globex, JAN, price_charged_usd_micros=500_000)
    invoices = {t.slug: do_build_invoice(t, JANUARY, finalize=True) for t in (acme, globex)}
    response = session(staff).get("/api/v1/chargeback/export.csv", {"month": "2026-01"})
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert {(r["cost_center"], r["team"], Decimal(r["total_usd"])) for r in rows} == {
        ("CC-100", "Search", invoices["acme"].total_usd),
        ("globex", "Globex", invoices["globex"].total_usd),
    }


def test_the_chargeback_needs_a_month(staff: Any) -> None:
    response = session(staff).get("/api/v1/chargeback/export.csv")
    assert response.status_code == 400
    assert "month" in response.json()


# ------------------------------------------------------------------------- price sheets


def sheet(model: str, **fields: Any) -> PriceSheet:
    values: dict[str, Any] = {
        "adapter": "",
        "tenant": None,
        "input_usd_per_mtok": Decimal("0.5"),
        "cached_input_usd_per_mtok": Decimal("0.1"),
        "output_usd_per_mtok": Decimal("1.5"),
        "effective_from": JAN,
    }
    values.update(fields)
    return PriceSheet.objects.create(model=model, **values)


@pytest.fixture
def catalogue(acme: Tenant, globex: Tenant) -> dict[str, PriceSheet]:
    make_model("llama-3.1-8b")
    make_model("qwen2.5-72b", visibility=Visibility.RESTRICTED, granted_tenant_ids=[globex.pk])
    return {
        "public": sheet("llama-3.1-8b"),
        "restricted": sheet("qwen2.5-72b"),
        "globex_own": sheet("llama-3.1-8b", tenant=globex, input_usd_per_mtok=Decimal("0.4")),
    }


def listed_ids(client: APIClient, **params: str) -> set[int]:
    return {row["id"] for row in client.get("/api/v1/price-sheets/", params).json()["results"]}


def test_a_tenant_sees_list_prices_of_models_visible_to_it(
    catalogue: dict[str, PriceSheet],
) -> None:
    assert listed_ids(session("acme-viewer")) == {catalogue["public"].pk}


def test_a_tenant_sees_its_own_prices_and_granted_models(catalogue: dict[str, PriceSheet]) -> None:
    assert listed_ids(session("globex-viewer")) == {s.pk for s in catalogue.values()}


def test_staff_see_every_price_sheet(catalogue: dict[str, PriceSheet], staff: Any) -> None:
    assert listed_ids(session(staff)) == set(PriceSheet.objects.values_list("pk", flat=True))


def test_a_hidden_price_sheet_is_a_404(catalogue: dict[str, PriceSheet]) -> None:
    url = f"/api/v1/price-sheets/{catalogue['restricted'].pk}/"
    assert session("acme-viewer").get(url).status_code == 404


def test_staff_create_a_price_sheet_and_the_price_book_is_republished(
    acme: Tenant, staff: Any, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    # Publishing goes through Celery (no broker here): see that it was scheduled, not run.
    with django_capture_on_commit_callbacks() as on_commit:
        response = session(staff).post(
            "/api/v1/price-sheets/",
            {
                "model": "llama-3.1-8b",
                "input_usd_per_mtok": "0.2",
                "cached_input_usd_per_mtok": "0.05",
                "output_usd_per_mtok": "0.4",
                "tier_multipliers": {"batch": "0.5"},
                "effective_from": "2026-02-01T00:00:00Z",
            },
            format="json",
        )
    assert response.status_code == 201, response.json()
    created = PriceSheet.objects.get(pk=response.json()["id"])
    assert (created.output_usd_per_mtok, created.tier_multipliers) == (
        Decimal("0.4"),
        {"batch": "0.5"},
    )
    assert on_commit == [Enqueue(publish_prices.name)]


def test_staff_update_a_price_sheet_and_the_price_book_is_republished(
    catalogue: dict[str, PriceSheet],
    staff: Any,
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    url = f"/api/v1/price-sheets/{catalogue['public'].pk}/"
    with django_capture_on_commit_callbacks() as on_commit:
        response = session(staff).patch(url, {"output_usd_per_mtok": "2.25"}, format="json")
    assert response.status_code == 200
    assert PriceSheet.objects.get(pk=catalogue["public"].pk).output_usd_per_mtok == Decimal("2.25")
    assert on_commit == [Enqueue(publish_prices.name)]


def test_staff_delete_a_price_sheet_and_the_price_book_is_republished(
    catalogue: dict[str, PriceSheet],
    staff: Any,
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    url = f"/api/v1/price-sheets/{catalogue['restricted'].pk}/"
    with django_capture_on_commit_callbacks() as on_commit:
        assert session(staff).delete(url).status_code == 204
    assert not PriceSheet.objects.filter(pk=catalogue["restricted"].pk).exists()
    assert on_commit == [Enqueue(publish_prices.name)]


def test_a_second_sheet_starting_at_the_same_time_is_a_400(
    catalogue: dict[str, PriceSheet], staff: Any
) -> None:
    before = PriceSheet.objects.count()
    response = session(staff).post(
        "/api/v1/price-sheets/",
        {
            "model": "llama-3.1-8b",
            "tenant": None,
            "input_usd_per_mtok": "1",
            "cached_input_usd_per_mtok": "1",
            "output_usd_per_mtok": "1",
            "effective_from": JAN.isoformat(),
        },
        format="json",
    )
    assert response.status_code == 400
    assert "effective_from" in response.json()
    assert PriceSheet.objects.count() == before


def test_a_negative_price_is_a_400(acme: Tenant, staff: Any) -> None:
    response = session(staff).post(
        "/api/v1/price-sheets/",
        {
            "model": "llama-3.1-8b",
            "input_usd_per_mtok": "-1",
            "cached_input_usd_per_mtok": "0",
            "output_usd_per_mtok": "0",
            "effective_from": JAN.isoformat(),
        },
        format="json",
    )
    assert response.status_code == 400
    assert "input_usd_per_mtok" in response.json()


def test_a_sheet_is_in_force_until_the_next_one_starts(
    catalogue: dict[str, PriceSheet], staff: Any
) -> None:
    march = JAN.replace(month=3)
    later = sheet("llama-3.1-8b", effective_from=march)
    client = session(staff)
    rows = client.get("/api/v1/price-sheets/", {"model": "llama-3.1-8b"}).json()["results"]
    until = {row["id"]: row["effective_until"] for row in rows}
    assert until[catalogue["public"].pk] == march.isoformat().replace("+00:00", "Z")
    assert until[later.pk] is None
    # the tenant's own sheet is not ended by a list sheet
    assert until[catalogue["globex_own"].pk] is None
    in_february = listed_ids(client, model="llama-3.1-8b", in_force_at="2026-02-15")
    assert in_february == {catalogue["public"].pk, catalogue["globex_own"].pk}


# ------------------------------------------------------------------------------- margin


def test_margin_by_model_is_revenue_minus_cost_from_rollups(acme: Tenant, staff: Any) -> None:
    rows = [
        rollup(
            acme,
            JAN,
            model="llama-3.1-8b",
            revenue_usd_micros=90_000,
            cost_to_serve_usd_micros=30_000,
        ),
        rollup(
            acme,
            JAN,
            model="llama-3.1-8b",
            pool="l4",
            revenue_usd_micros=10_000,
            cost_to_serve_usd_micros=15_000,
        ),
        rollup(
            acme,
            JAN,
            model="qwen2.5-72b",
            revenue_usd_micros=50_000,
            cost_to_serve_usd_micros=60_000,
        ),
    ]
    body = (
        session(staff)
        .get("/api/v1/margin/", {"start": "2026-01-01", "end": "2026-01-02", "by": "model"})
        .json()
    )
    want: dict[str, Decimal] = {}
    for r in rows:
        want[r.model] = want.get(r.model, Decimal(0)) + micros_to_usd(
            r.revenue_usd_micros - r.cost_to_serve_usd_micros
        )
    assert {row["key"]: Decimal(row["margin_usd"]) for row in body["rows"]} == want
    assert Decimal(body["totals"]["margin_usd"]) == sum(want.values())


def test_margin_by_pool_groups_by_pool(acme: Tenant, globex: Tenant, staff: Any) -> None:
    rollup(acme, JAN, pool="h100-east")
    rollup(globex, JAN, pool="h100-east")
    rollup(acme, JAN, pool="l4-west", model="qwen2.5-72b")
    body = (
        session(staff)
        .get("/api/v1/margin/", {"start": "2026-01-01", "end": "2026-01-02", "by": "pool"})
        .json()
    )
    assert {row["key"]: row["requests"] for row in body["rows"]} == {
        pool: sum(HourlyRollup.objects.filter(pool=pool).values_list("requests", flat=True))
        for pool in ("h100-east", "l4-west")
    }


def replica_hour(hour: datetime, replica_id: str, pool: str, **fields: Any) -> ReplicaHour:
    values: dict[str, Any] = {
        "deployment_id": 1,
        "model": "llama-3.1-8b",
        "gpus": 1,
        "usd_micros_per_gpu_hour": 3_600_000,
        "ready_us": 3_600_000_000,
        "requests": 0,
        "gpu_seconds": 3600.0,
        "idle_gpu_seconds": 3600.0,
        "cost_usd_micros": 3_600_000,
        "idle_usd_micros": 3_600_000,
        "as_of": hour + timedelta(hours=1),
    }
    values.update(fields)
    return ReplicaHour.objects.create(hour=hour, replica_id=replica_id, pool=pool, **values)


def test_margin_charges_the_fleets_whole_ready_time_idle_included(
    acme: Tenant, globex: Tenant, staff: Any
) -> None:
    rollup(acme, JAN, pool="h100-east", gpu_seconds=36.0, cost_to_serve_usd_micros=36_000)
    rollup(globex, JAN, pool="h100-east", gpu_seconds=4.0, cost_to_serve_usd_micros=4_000)
    replica_hour(
        JAN, "1", "h100-east", requests=20, idle_gpu_seconds=3560.0, idle_usd_micros=3_560_000
    )
    replica_hour(
        JAN,
        "2",
        "l4-west",
        usd_micros_per_gpu_hour=720_000,
        cost_usd_micros=720_000,
        idle_usd_micros=720_000,
    )
    client = session(staff)
    window = {"start": "2026-01-01T00:30:00Z", "end": "2026-01-01T02:00:00Z"}
    by_pool = client.get("/api/v1/margin/", {**window, "by": "pool"}).json()
    rows = {row["key"]: row for row in by_pool["rows"]}
    assert rows["h100-east"]["gpu_seconds"] == pytest.approx(3600.0)
    assert Decimal(rows["h100-east"]["cost_usd"]) == Decimal("3.600000")
    assert Decimal(rows["l4-west"]["idle_cost_usd"]) == Decimal("0.720000")
    totals = by_pool["totals"]
    assert totals["gpu_seconds"] == pytest.approx(totals["fleet_gpu_seconds"]) == 7200.0
    assert Decimal(totals["cost_usd"]) == Decimal(totals["fleet_cost_usd"]) == Decimal("4.32")
    assert totals["as_of"] == "2026-01-01T01:00:00Z"
    by_tenant = client.get("/api/v1/margin/", {**window, "by": "tenant"}).json()
    tenants = {row["key"]: row for row in by_tenant["rows"]}
    assert set(tenants) == {"acme", "globex", "idle"}
    assert Decimal(tenants["idle"]["cost_usd"]) == Decimal("4.280000")
    assert Decimal(by_tenant["totals"]["cost_usd"]) == Decimal("4.32")


def test_a_margin_percentage_only_from_ten_dollars_of_revenue(acme: Tenant, staff: Any) -> None:
    rollup(acme, JAN, model="small", revenue_usd_micros=6_100, cost_to_serve_usd_micros=40_000)
    rollup(
        acme, JAN, model="big", revenue_usd_micros=20_000_000, cost_to_serve_usd_micros=5_000_000
    )
    body = session(staff).get("/api/v1/margin/", {"start": "2026-01-01", "end": "2026-01-02"})
    rows = {row["key"]: row for row in body.json()["rows"]}
    assert rows["small"]["margin_pct"] is None
    assert Decimal(rows["small"]["revenue_usd"]) == Decimal("0.006100")
    assert rows["big"]["margin_pct"] == pytest.approx(75.0)


def test_the_margin_report_exports_as_csv_with_its_total(acme: Tenant, staff: Any) -> None:
    rollup(acme, JAN, pool="h100-east", revenue_usd_micros=90_000, baseline_cost_usd_micros=50_000)
    replica_hour(JAN, "1", "h100-east")
    reply = session(staff).get(
        "/api/v1/margin/export.csv", {"start": "2026-01-01", "end": "2026-01-02", "by": "pool"}
    )
    assert reply.status_code == 200 and reply["Content-Type"].startswith("text/csv")
    lines = list(csv.DictReader(io.StringIO(reply.content.decode())))
    assert [line["pool"] for line in lines] == ["h100-east", "total"]
    assert Decimal(lines[0]["revenue_usd"]) == Decimal("0.09")
    assert Decimal(lines[0]["saving_vs_least_load_usd"]) == Decimal("0.01")
    assert Decimal(lines[1]["cost_usd"]) == Decimal("3.64")
    forbidden = session(user("acme-dev")).get("/api/v1/margin/export.csv")
    assert forbidden.status_code == 403


def test_margin_by_an_unknown_dimension_is_a_400(staff: Any) -> None:
    response = session(staff).get("/api/v1/margin/", {"by": "region"})
    assert response.status_code == 400
    assert "by" in response.json()


# ------------------------------------------------------------ staff-only routes and tenants


def metering_snapshot(redis_client: Any) -> str:
    rows = {
        model.__name__: sorted(map(str, model._default_manager.values()))
        for model in apps.get_app_config("metering").get_models()
    }
    return json.dumps([rows, str(redis_client.get(PRICE_BOOK_KEY))], default=str)


@pytest.mark.parametrize("credentials", ["acme-owner session", "acme manage key"])
def test_staff_only_routes_refuse_a_tenant_with_403_and_change_nothing(
    catalogue: dict[str, PriceSheet], redis_client: Any, credentials: str, run_on_commit: Any
) -> None:
    acme = Tenant.objects.get(slug="acme")
    client = (
        session("acme-owner") if credentials == "acme-owner session" else bearer(acme, ["manage"])
    )
    visible = f"/api/v1/price-sheets/{catalogue['public'].pk}/"
    before = metering_snapshot(redis_client)
    answers = {
        "rollups": client.get("/api/v1/rollups/").status_code,
        "margin": client.get("/api/v1/margin/").status_code,
        "close": client.post(
            "/api/v1/invoices/close/", {"tenant": "acme", "month": "2026-01"}, format="json"
        ).status_code,
        "chargeback": client.get("/api/v1/chargeback/export.csv?month=2026-01").status_code,
        "create sheet": client.post(
            "/api/v1/price-sheets/", {"model": "x", "input_usd_per_mtok": "0"}, format="json"
        ).status_code,
        "update sheet": client.patch(
            visible, {"output_usd_per_mtok": "0"}, format="json"
        ).status_code,
        "delete sheet": client.delete(visible).status_code,
    }
    assert answers == dict.fromkeys(answers, 403)
    assert metering_snapshot(redis_client) == before


def test_anonymous_callers_are_refused_everywhere(acme_invoice: Invoice) -> None:
    client = APIClient()
    urls = [
        "/api/v1/tenants/acme/usage/",
        f"/api/v1/tenants/acme/invoices/{acme_invoice.pk}/export.csv",
        "/api/v1/price-sheets/",
        "/api/v1/margin/",
    ]
    assert {url: client.get(url).status_code for url in urls} == dict.fromkeys(urls, 403)


# ------------------------------------------------------------ the cross-tenant matrix

METHODS = ["get", "post", "put", "patch", "delete"]
ANY_BODY = {"tenant": "acme", "month": "2026-01", "status": "finalized", "total_usd": "0"}


def tenant_scoped_routes(acme_invoice: int) -> dict[str, list[str]]:
    """Every tenant-scoped route name, with the URLs that reach acme's rows through it:
    acme's own URL, and acme's invoice id under globex's URL."""
    invoice = f"/api/v1/tenants/acme/invoices/{acme_invoice}"
    under_globex = f"/api/v1/tenants/globex/invoices/{acme_invoice}"
    return {
        "tenant-usage": ["/api/v1/tenants/acme/usage/?start=2026-01-01&end=2026-02-01"],
        "tenant-usage-events": ["/api/v1/tenants/acme/usage/events/"],
        "tenant-rollups": ["/api/v1/tenants/acme/rollups/"],
        "tenant-invoice-list": ["/api/v1/tenants/acme/invoices/"],
        "tenant-invoice-detail": [f"{invoice}/", f"{under_globex}/"],
        "tenant-invoice-csv": [f"{invoice}/export.csv", f"{under_globex}/export.csv"],
        "tenant-invoice-json": [f"{invoice}/export.json", f"{under_globex}/export.json"],
    }


def route_methods(url: str) -> set[str]:
    return set(resolve(url.split("?")[0]).func.actions)  # type: ignore[attr-defined]


@pytest.mark.parametrize("credentials", ["globex-owner session", "globex manage key"])
def test_globex_gets_404_on_every_acme_route_by_every_method_and_changes_nothing(
    acme_invoice: Invoice, globex: Tenant, redis_client: Any, credentials: str, run_on_commit: Any
) -> None:
    rollup(acme_invoice.tenant, JAN)
    if credentials == "globex manage key":
        client = bearer(globex, ["manage"])
    else:
        client = session("globex-owner")
    routes = tenant_scoped_routes(acme_invoice.pk)
    every_route = {
        p.name
        for p in metering_urls.urlpatterns
        if isinstance(p, URLPattern) and p.name and p.name.startswith("tenant-")
    }
    assert set(routes) == every_route, "a tenant-scoped route is missing from the matrix"

    before = metering_snapshot(redis_client)
    answers = {
        (method, url): getattr(client, method)(url, ANY_BODY, format="json").status_code
        for urls in routes.values()
        for url in urls
        for method in METHODS
    }
    # A method the route does not have may answer 405: the same for any id, so it reveals
    # nothing. Every method the route has answers 404.
    wrong = {
        (method, url): code
        for (method, url), code in answers.items()
        if code != 404 and not (code == 405 and method not in route_methods(url))
    }
    assert wrong == {}
    assert sum(1 for (m, u) in answers if m in route_methods(u)) == 10
    assert metering_snapshot(redis_client) == before
