"""The console's price-sheet, budget and usage-search pages through Django's test client: each
form's success, each bad input refused with a message and nothing changed, the usage filters
and their CSV, and staff only."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import parse_qsl

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from config.jobs import Enqueue
from metering.models import PriceSheet, UsageEvent
from metering.tasks import publish_prices
from tenants.actions import do_create_api_key
from tenants.models import ApiKey, Quota, Tenant
from tests.metering.helpers import stored as store
from tests.registry.conftest import make_model
from tests.tenants.conftest import make_tenant, user

JAN = datetime(2026, 1, 1, tzinfo=UTC)
RANGE = {"start": "2026-01-01", "end": "2026-02-01"}
LONG = "x" * 100_000


@pytest.fixture
def acme(db: None, redis_client: Any) -> Tenant:
    return make_tenant("acme")


@pytest.fixture
def globex(db: None, redis_client: Any) -> Tenant:
    return make_tenant("globex")


@pytest.fixture
def staff(db: None) -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    return client


@pytest.fixture
def llama(db: None) -> None:
    make_model("llama-3.1-8b")


def messages_of(reply: Any) -> list[str]:
    return [str(m) for m in reply.context["messages"]]


def last_message(reply: Any) -> str:
    """The message of the last form sent (earlier ones queue up unread, the redirects unread)."""
    return messages_of(reply)[-1]


# ------------------------------------------------------------------------- price sheets

PRICE_FORM = {
    "model": "llama-3.1-8b",
    "adapter": "",
    "tenant": "",
    "input_usd_per_mtok": "0.20",
    "cached_input_usd_per_mtok": "0.05",
    "output_usd_per_mtok": "0.60",
    "tier_interactive": "1.25",
    "tier_standard": "",
    "tier_batch": "0.5",
    "effective_from": "2026-02-01T00:00",
}


def test_staff_create_a_price_sheet_and_the_price_book_is_republished(
    staff: Client, llama: None, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    with django_capture_on_commit_callbacks() as on_commit:
        reply = staff.post("/console/prices/new/", PRICE_FORM)
    assert (reply.status_code, reply["Location"]) == (302, "/console/prices/")
    sheet = PriceSheet.objects.get()
    assert (sheet.model, sheet.tenant, sheet.effective_from) == (
        "llama-3.1-8b",
        None,
        datetime(2026, 2, 1, tzinfo=UTC),
    )
    assert (sheet.input_usd_per_mtok, sheet.output_usd_per_mtok) == (
        Decimal("0.2"),
        Decimal("0.6"),
    )
    assert sheet.tier_multipliers == {"interactive": "1.25", "batch": "0.5"}
    assert on_commit == [Enqueue(publish_prices.name)]
    page = staff.get("/console/prices/")
    assert any("in force from 2026-02-01 00:00" in m for m in messages_of(page))


def test_a_tenant_price_sheet_names_its_tenant(staff: Client, llama: None, acme: Tenant) -> None:
    staff.post("/console/prices/new/", {**PRICE_FORM, "tenant": "acme"})
    assert PriceSheet.objects.get().tenant == acme


def test_a_sheet_without_a_start_supersedes_the_one_in_force_from_now(
    staff: Client, llama: None
) -> None:
    old = PriceSheet.objects.create(
        model="llama-3.1-8b",
        input_usd_per_mtok=Decimal("1"),
        cached_input_usd_per_mtok=Decimal("1"),
        output_usd_per_mtok=Decimal("1"),
        effective_from=JAN,
    )
    before = timezone.now()
    staff.post("/console/prices/new/", {**PRICE_FORM, "effective_from": ""})
    new = PriceSheet.objects.exclude(pk=old.pk).get()
    assert before <= new.effective_from <= timezone.now()
    page = staff.get("/console/prices/").content.decode()
    rows = {s.pk: page[page.index(f'data-sheet="{s.pk}"') :].split("</tr>")[0] for s in (old, new)}
    assert "superseded" in rows[old.pk] and "in force" in rows[new.pk]


BAD_PRICES = [
    ({"input_usd_per_mtok": "-1"}, "Input price"),
    ({"output_usd_per_mtok": "lots"}, "Output price"),
    ({"cached_input_usd_per_mtok": "10000000"}, "Cached input price"),
    ({"model": "no-such-model"}, "Unknown model"),
    ({"model": LONG}, "Model"),
    ({"adapter": LONG}, "Adapter"),
    ({"tier_batch": "-0.5"}, "Tier multipliers"),
    ({"tier_batch": LONG}, "Tier multipliers"),
    ({"tenant": "nobody"}, "Tenant"),
    ({"effective_from": "yesterday"}, "In force from"),
    ({"effective_from": "9999-12-31T23:59"}, "In force from"),
]


@pytest.mark.parametrize(("bad", "named"), BAD_PRICES)
def test_a_bad_price_sheet_is_refused_with_a_message_and_nothing_saved(
    staff: Client,
    llama: None,
    bad: dict[str, str],
    named: str,
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    with django_capture_on_commit_callbacks() as on_commit:
        reply = staff.post("/console/prices/new/", {**PRICE_FORM, **bad}, follow=True)
    assert reply.status_code == 200
    (message,) = messages_of(reply)
    assert message.startswith("Not saved: ") and named in message
    assert not PriceSheet.objects.exists()
    assert on_commit == []


def test_a_second_sheet_starting_at_the_same_time_is_refused(staff: Client, llama: None) -> None:
    staff.post("/console/prices/new/", PRICE_FORM)
    reply = staff.post(
        "/console/prices/new/", {**PRICE_FORM, "output_usd_per_mtok": "9"}, follow=True
    )
    assert "starts then" in last_message(reply)
    assert PriceSheet.objects.get().output_usd_per_mtok == Decimal("0.6")


def test_a_refused_form_keeps_what_was_typed(staff: Client, llama: None) -> None:
    reply = staff.post(
        "/console/prices/new/", {**PRICE_FORM, "input_usd_per_mtok": "-3"}, follow=True
    )
    assert 'value="-3"' in reply.content.decode()


def test_a_scheduled_sheet_can_be_deleted(staff: Client, llama: None) -> None:
    staff.post("/console/prices/new/", {**PRICE_FORM, "effective_from": "2099-01-01T00:00"})
    sheet = PriceSheet.objects.get()
    reply = staff.post(f"/console/prices/{sheet.pk}/delete/", follow=True)
    assert "deleted" in last_message(reply)
    assert not PriceSheet.objects.exists()


def test_a_sheet_that_was_in_force_is_not_deleted(staff: Client, llama: None) -> None:
    staff.post("/console/prices/new/", PRICE_FORM)
    sheet = PriceSheet.objects.get()
    reply = staff.post(f"/console/prices/{sheet.pk}/delete/", follow=True)
    assert "supersede it" in last_message(reply)
    assert PriceSheet.objects.filter(pk=sheet.pk).exists()


# ------------------------------------------------------------------------------ budgets

BUDGET_FORM = {
    "monthly_spend_budget_usd": "250.00",
    "monthly_token_budget": "5000000",
    "soft_alert_percent": "75",
    "hard_budget": "on",
}


def quota_of(tenant: Tenant) -> tuple[Any, ...]:
    quota = Quota.objects.get(tenant=tenant)
    return (
        quota.monthly_spend_budget_usd,
        quota.monthly_token_budget,
        quota.soft_alert_fraction,
        quota.hard_budget,
    )


def test_staff_set_a_tenant_budget(staff: Client, acme: Tenant) -> None:
    reply = staff.post("/console/budgets/acme/set/", BUDGET_FORM)
    assert (reply.status_code, reply["Location"]) == (302, "/console/budgets/acme/")
    assert quota_of(acme) == (Decimal("250.00"), 5_000_000, 0.75, True)
    page = staff.get("/console/budgets/acme/")
    assert messages_of(page) == ["Budget of Acme saved."]
    assert 'value="250.00"' in page.content.decode()


def test_staff_change_a_budget_to_a_soft_one_without_a_token_budget(
    staff: Client, acme: Tenant
) -> None:
    staff.post("/console/budgets/acme/set/", BUDGET_FORM)
    changed = {**BUDGET_FORM, "monthly_spend_budget_usd": "90", "monthly_token_budget": ""}
    del changed["hard_budget"]
    staff.post("/console/budgets/acme/set/", changed)
    assert quota_of(acme) == (Decimal("90"), None, 0.75, False)


def test_staff_remove_a_budget(staff: Client, acme: Tenant) -> None:
    staff.post("/console/budgets/acme/set/", BUDGET_FORM)
    reply = staff.post("/console/budgets/acme/remove/", follow=True)
    assert last_message(reply) == "Budget of Acme removed."
    assert quota_of(acme)[:2] == (None, None)


def test_the_budget_list_shows_every_tenant(staff: Client, acme: Tenant, globex: Tenant) -> None:
    staff.post("/console/budgets/acme/set/", BUDGET_FORM)
    page = staff.get("/console/budgets/").content.decode()
    assert 'data-tenant="acme"' in page and 'data-tenant="globex"' in page
    assert "$250.00" in page


BAD_BUDGETS = [
    ({"soft_alert_percent": "150"}, "Alert threshold"),
    ({"soft_alert_percent": "0"}, "Alert threshold"),
    ({"soft_alert_percent": ""}, "Alert threshold"),
    ({"monthly_spend_budget_usd": "-5"}, "Monthly spend budget"),
    ({"monthly_spend_budget_usd": "1.234"}, "Monthly spend budget"),
    ({"monthly_spend_budget_usd": LONG}, "Monthly spend budget"),
    ({"monthly_token_budget": "-1"}, "Monthly token budget"),
    ({"monthly_token_budget": "lots"}, "Monthly token budget"),
    ({"monthly_token_budget": LONG}, "Monthly token budget"),
]


@pytest.mark.parametrize(("bad", "named"), BAD_BUDGETS)
def test_a_bad_budget_is_refused_with_a_message_and_nothing_changed(
    staff: Client, acme: Tenant, bad: dict[str, str], named: str
) -> None:
    staff.post("/console/budgets/acme/set/", BUDGET_FORM)
    before = quota_of(acme)
    reply = staff.post("/console/budgets/acme/set/", {**BUDGET_FORM, **bad}, follow=True)
    assert reply.status_code == 200
    message = last_message(reply)
    assert message.startswith("Not saved: ") and named in message
    assert quota_of(acme) == before


def test_an_unknown_tenant_budget_is_a_404(staff: Client, db: None) -> None:
    assert staff.get("/console/budgets/nobody/").status_code == 404
    assert staff.post("/console/budgets/nobody/set/", BUDGET_FORM).status_code == 404


# ------------------------------------------------------------------------- usage search


@pytest.fixture
def traffic(acme: Tenant, globex: Tenant) -> dict[str, UsageEvent]:
    """Five January requests that differ in one dimension each from the first."""
    key, _ = do_create_api_key(acme, "ci", user("acme-owner"), ["inference"])
    other_key, _ = do_create_api_key(acme, "batch", user("acme-owner"), ["inference"])
    return {
        "base": store(acme, JAN + timedelta(days=1), key_id=key.pk, price_charged_usd_micros=1_500),
        "globex": store(globex, JAN + timedelta(days=2), key_id=None),
        "other_key": store(acme, JAN + timedelta(days=3), key_id=other_key.pk),
        "qwen": store(acme, JAN + timedelta(days=4), key_id=key.pk, model="qwen2.5-7b"),
        "error": store(acme, JAN + timedelta(days=5), key_id=key.pk, status="error"),
        "february": store(acme, JAN + timedelta(days=40), key_id=key.pk),
    }


def shown(reply: Any) -> list[str]:
    assert reply.status_code == 200
    assert reply.context.get("error") is None, reply.context["error"]
    return [row["event"].request_id for row in reply.context["rows"]]


def ids(traffic: dict[str, UsageEvent], *names: str) -> list[str]:
    """Newest first, as the page lists them."""
    chosen = [traffic[name] for name in names]
    return [e.request_id for e in sorted(chosen, key=lambda e: e.started_at, reverse=True)]


def test_the_usage_search_lists_the_range_newest_first(
    staff: Client, traffic: dict[str, UsageEvent]
) -> None:
    reply = staff.get("/console/usage/", RANGE)
    assert shown(reply) == ids(traffic, "base", "globex", "other_key", "qwen", "error")


def test_the_usage_search_defaults_to_the_last_30_days(staff: Client, acme: Tenant) -> None:
    recent = store(acme, timezone.now() - timedelta(days=1))
    store(acme, timezone.now() - timedelta(days=31))
    assert shown(staff.get("/console/usage/")) == [recent.request_id]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"tenant": "globex"}, ("globex",)),
        ({"model": "qwen2.5-7b"}, ("qwen",)),
        ({"status": "error"}, ("error",)),
        ({"start": "2026-01-03", "end": "2026-01-05"}, ("globex", "other_key")),
        ({"start": "2026-01-04T00:00:00Z", "end": "2026-01-04T00:00:01Z"}, ("other_key",)),
    ],
)
def test_the_usage_search_narrows_by_each_filter(
    staff: Client, traffic: dict[str, UsageEvent], filters: dict[str, str], expected: tuple[str]
) -> None:
    assert shown(staff.get("/console/usage/", {**RANGE, **filters})) == ids(traffic, *expected)


def test_the_usage_search_narrows_by_key_prefix_or_id(
    staff: Client, traffic: dict[str, UsageEvent]
) -> None:
    key = ApiKey.objects.get(pk=traffic["other_key"].key_id or 0)
    for given in (key.prefix, f"sk-{key.prefix}…", str(key.pk)):
        reply = staff.get("/console/usage/", {**RANGE, "key": given})
        assert shown(reply) == ids(traffic, "other_key"), given
    assert f"sk-{key.prefix}…" in reply.content.decode()


def test_the_filters_combine(staff: Client, traffic: dict[str, UsageEvent]) -> None:
    params = {**RANGE, "tenant": "acme", "model": "llama-3.1-8b", "status": "ok"}
    assert shown(staff.get("/console/usage/", params)) == ids(traffic, "base", "other_key")


def test_an_htmx_search_answers_the_results_alone(
    staff: Client, traffic: dict[str, UsageEvent]
) -> None:
    reply = staff.get("/console/usage/", {**RANGE, "status": "error"}, HTTP_HX_REQUEST="true")
    body = reply.content.decode()
    assert "<html" not in body and traffic["error"].request_id in body


def test_the_usage_search_pages_by_keyset_without_overlap(
    staff: Client, acme: Tenant, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    events = [store(acme, JAN + timedelta(minutes=n)) for n in range(120)]
    newest_first = [e.request_id for e in reversed(events)]
    seen: list[str] = []
    params: dict[str, str] = dict(RANGE)
    while True:
        with django_assert_max_num_queries(12):
            reply = staff.get("/console/usage/", params)
        seen += shown(reply)
        if "next_query" not in reply.context:
            break
        params = dict(parse_qsl(reply.context["next_query"]))
    assert seen == newest_first
    assert len(reply.context["rows"]) == 20


BAD_SEARCHES = [
    ({"status": "bogus"}, "Status"),
    ({"start": "not-a-date"}, "From"),
    ({"end": "2026-02-30"}, "To"),
    ({"start": "2026-02-01", "end": "2026-01-01"}, "Must be after start"),
    ({"model": LONG}, "Model"),
    ({"tenant": "nobody"}, "No such tenant"),
    ({"key": "nope"}, "No such API key"),
    ({"key": LONG}, "API key"),
    ({"before": "garbage"}, "Page"),
    ({"start": "9999-01-01"}, "From"),
]


@pytest.mark.parametrize(("bad", "named"), BAD_SEARCHES)
def test_a_bad_filter_shows_its_message_on_the_form(
    staff: Client, traffic: dict[str, UsageEvent], bad: dict[str, str], named: str
) -> None:
    reply = staff.get("/console/usage/", {**RANGE, **bad})
    assert reply.status_code == 200
    assert named in reply.context["error"]
    assert reply.context["rows"] == []
    assert 'id="usage-error"' in reply.content.decode()


def csv_rows(reply: Any) -> list[dict[str, str]]:
    assert reply.status_code == 200 and reply["Content-Type"].startswith("text/csv")
    assert reply.streaming, "the export is streamed"
    return list(csv.DictReader(io.StringIO(reply.getvalue().decode())))


def test_the_csv_has_the_header_and_exactly_the_filtered_rows(
    staff: Client, traffic: dict[str, UsageEvent]
) -> None:
    reply = staff.get("/console/usage/export.csv", {**RANGE, "tenant": "acme", "status": "ok"})
    assert reply["Content-Disposition"].startswith('attachment; filename="usage-')
    rows = csv_rows(reply)
    assert [r["request_id"] for r in rows] == ids(traffic, "base", "other_key", "qwen")
    base = rows[-1]
    key = ApiKey.objects.get(pk=traffic["base"].key_id or 0)
    assert base == {
        "started_at": "2026-01-02T00:00:00+00:00",
        "request_id": traffic["base"].request_id,
        "tenant": "acme",
        "key_prefix": key.prefix,
        "model": "llama-3.1-8b",
        "status": "ok",
        "prompt_tokens": str(traffic["base"].prompt_tokens),
        "cached_prompt_tokens": "0",
        "completion_tokens": str(traffic["base"].completion_tokens),
        "ttft_ms": "80.0",
        "tpot_ms": str(round(820.0 / (traffic["base"].completion_tokens - 1), 2)),
        "slo": "met",  # a standard request within 3 s and 100 ms a token
        "total_ms": "900.0",
        "price_charged_usd": "0.001500",
        "replica": "r1",
        "pool": "h100-east",
        "prefill_pool": "",
    }


def test_the_csv_of_no_rows_is_its_header(staff: Client, traffic: dict[str, UsageEvent]) -> None:
    reply = staff.get("/console/usage/export.csv", {**RANGE, "model": "none-such"})
    assert reply.getvalue().decode().splitlines() == [
        "started_at,request_id,tenant,key_prefix,model,status,prompt_tokens,cached_prompt_tokens,"
        "completion_tokens,ttft_ms,tpot_ms,slo,total_ms,price_charged_usd,replica,pool,prefill_pool"
    ]


def test_the_csv_walks_every_batch(
    staff: Client, acme: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("metering.console_views.CSV_BATCH", 7)
    events = [store(acme, JAN + timedelta(minutes=n)) for n in range(30)]
    rows = csv_rows(staff.get("/console/usage/export.csv", RANGE))
    assert [r["request_id"] for r in rows] == [e.request_id for e in reversed(events)]


def test_the_csv_stops_at_its_row_limit(
    staff: Client, acme: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("metering.console_views.CSV_MAX_ROWS", 5)
    monkeypatch.setattr("metering.console_views.CSV_BATCH", 3)
    events = [store(acme, JAN + timedelta(minutes=n)) for n in range(9)]
    rows = csv_rows(staff.get("/console/usage/export.csv", RANGE))
    assert [r["request_id"] for r in rows] == [e.request_id for e in reversed(events)][:5]


def test_a_bad_csv_filter_goes_back_to_the_form_with_its_message(
    staff: Client, traffic: dict[str, UsageEvent]
) -> None:
    reply = staff.get("/console/usage/export.csv", {**RANGE, "status": "bogus"}, follow=True)
    assert reply.redirect_chain[0][0].startswith("/console/usage/?")
    assert any(m.startswith("No export: Status") for m in messages_of(reply))


# ---------------------------------------------------------------------------- staff only

PAGES = ["/console/prices/", "/console/budgets/", "/console/budgets/acme/", "/console/usage/"]
PAGES += ["/console/usage/export.csv"]
POSTS = {
    "/console/prices/new/": PRICE_FORM,
    "/console/budgets/acme/set/": BUDGET_FORM,
    "/console/budgets/acme/remove/": {},
}


@pytest.mark.parametrize("path", PAGES)
def test_a_page_is_refused_to_a_tenant_member_and_asks_a_stranger_to_log_in(
    acme: Tenant, path: str
) -> None:
    member = Client()
    member.force_login(user("acme-owner"))
    assert member.get(path).status_code == 403
    reply = Client().get(path)
    assert reply.status_code == 302 and reply["Location"].startswith("/login/")


@pytest.mark.parametrize("path", sorted(POSTS))
def test_a_form_is_refused_to_a_tenant_member_and_changes_nothing(
    acme: Tenant, llama: None, path: str
) -> None:
    before = quota_of(acme)
    member = Client()
    member.force_login(user("acme-owner"))
    assert member.post(path, POSTS[path]).status_code == 403
    assert quota_of(acme) == before and not PriceSheet.objects.exists()


def test_a_member_cannot_delete_a_price_sheet(staff: Client, acme: Tenant, llama: None) -> None:
    staff.post("/console/prices/new/", {**PRICE_FORM, "effective_from": "2099-01-01T00:00"})
    member = Client()
    member.force_login(user("acme-owner"))
    sheet = PriceSheet.objects.get()
    assert member.post(f"/console/prices/{sheet.pk}/delete/").status_code == 403
    assert PriceSheet.objects.filter(pk=sheet.pk).exists()
