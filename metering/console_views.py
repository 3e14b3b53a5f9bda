"""Console pages (staff) that change billing: price sheets, tenants' monthly budgets, and the
usage-event search with its CSV export.

Forms are parsed by the REST API's own serializers (`PriceSheetSerializer`, `QuotaSerializer`,
the API's time-range query) and written by the same `do_*` actions, so the console refuses what
the API refuses, with the same words. A refused form changes nothing and says why; a
successful one redirects (POST-redirect-GET) with a message.

The usage search pages by keyset on (started_at, request_id), newest first, inside a time
range that is always bounded (30 days by default): the range prunes the month partitions and
is a BRIN range on `started_at`, and with a tenant it is the (tenant_id, started_at) B-tree.
The CSV walks the same order in keyset batches and stops at `CSV_MAX_ROWS`.
"""

from __future__ import annotations

import csv
from collections.abc import AsyncIterator, Iterable, Iterator
from datetime import datetime
from typing import Any, cast
from urllib.parse import urlencode

from asgiref.sync import sync_to_async
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.core.handlers.asgi import ASGIRequest
from django.db.models import Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, QueryDict, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_POST
from rest_framework import serializers

from config.ids import row_id
from config.views import staff_required
from metering import actions
from metering.api.filters import TimeRangeQuery
from metering.api.serializers import PriceSheetSerializer
from metering.api.views import with_effective_until
from metering.models import PriceSheet, UsageEvent, micros_to_usd
from metering.usage import STATUSES
from metering.views import budget_figures
from registry.actions import visible_models_for_user
from tenants import actions as tenant_actions
from tenants.api.serializers import QuotaSerializer
from tenants.models import ApiKey, PriorityTier, Tenant

PAGE_SIZE = 50
CSV_MAX_ROWS = 100_000
CSV_BATCH = 2_000
NEWEST_FIRST = ("-started_at", "-request_id")
CSV_HEADER = (
    "started_at",
    "request_id",
    "tenant",
    "key_prefix",
    "model",
    "status",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "ttft_ms",
    "tpot_ms",
    "slo",
    "total_ms",
    "price_charged_usd",
    "replica",
    "pool",
    "prefill_pool",
)
LABELS = {
    "model": "Model",
    "adapter": "Adapter",
    "tenant": "Tenant",
    "key": "API key",
    "status": "Status",
    "start": "From",
    "end": "To",
    "before": "Page",
    "input_usd_per_mtok": "Input price",
    "cached_input_usd_per_mtok": "Cached input price",
    "output_usd_per_mtok": "Output price",
    "tier_multipliers": "Tier multipliers",
    "effective_from": "In force from",
    "monthly_spend_budget_usd": "Monthly spend budget",
    "monthly_token_budget": "Monthly token budget",
    "soft_alert_fraction": "Alert threshold",
    "soft_alert_percent": "Alert threshold",
    "hard_budget": "Hard budget",
}


def errors_text(errors: Any) -> str:
    """A serializer's or a ValidationError's errors as one line naming the fields."""
    if isinstance(errors, ValidationError):
        errors = errors.message_dict if hasattr(errors, "error_dict") else {"": errors.messages}
    if not isinstance(errors, dict):
        errors = {"": errors}
    parts = []
    for field, problems in errors.items():
        if isinstance(problems, dict):  # a DictField's errors, per key
            problems = [f"{key}: {' '.join(map(str, msgs))}" for key, msgs in problems.items()]
        text = " ".join(str(problem) for problem in problems)
        label = LABELS.get(field, field.replace("_", " ").capitalize())
        parts.append(f"{label}: {text}" if field and field != "non_field_errors" else text)
    return "; ".join(parts)


def _given(data: QueryDict, names: Iterable[str]) -> dict[str, str]:
    """The named form fields that were filled in (a blank one means "not given")."""
    values = {name: str(data.get(name) or "").strip() for name in names}
    return {name: value for name, value in values.items() if value}


# ------------------------------------------------------------------------- price sheets


def _sheets(user: Any) -> QuerySet[PriceSheet]:
    sheets = with_effective_until(actions.access_price_sheets(user)).select_related("tenant")
    return sheets.order_by("model", "adapter", "tenant_id", "-effective_from")


def _sheet_state(sheet: Any, now: datetime) -> str:
    if sheet.effective_from > now:
        return "scheduled"
    if sheet.effective_until is not None and sheet.effective_until <= now:
        return "superseded"
    return "in force"


@staff_required
def prices_page(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    sheets = list(_sheets(request.user))
    for sheet in sheets:
        sheet.state = _sheet_state(sheet, now)  # type: ignore[attr-defined]
    context = {
        "sheets": sheets,
        "models": visible_models_for_user(request.user).order_by("name"),
        "tenants": Tenant.objects.order_by("slug"),
        "tiers": PriorityTier.values,
        "form": request.session.pop("price_form", {}),
    }
    return render(request, "console/prices.html", context)


def _price_sheet_data(data: QueryDict) -> dict[str, Any]:
    fields: dict[str, Any] = _given(
        data,
        (
            "model",
            "adapter",
            "tenant",
            "input_usd_per_mtok",
            "cached_input_usd_per_mtok",
            "output_usd_per_mtok",
            "effective_from",
        ),
    )
    fields.setdefault("effective_from", timezone.now().isoformat())
    multipliers = _given(data, [f"tier_{tier}" for tier in PriorityTier.values])
    fields["tier_multipliers"] = {name.removeprefix("tier_"): v for name, v in multipliers.items()}
    return fields


@staff_required
@require_POST
def create_price_sheet(request: HttpRequest) -> HttpResponse:
    """A new sheet for a model (or one adapter, or one tenant): from its start it supersedes
    the sheet in force for the same model, adapter and tenant, as a POST to the API does."""
    data = _price_sheet_data(request.POST)
    serializer = PriceSheetSerializer(data=data)
    try:
        if not serializer.is_valid():
            raise ValidationError(errors_text(serializer.errors))
        fields = dict(serializer.validated_data)
        actions.check_known_model(request.user, fields["model"])
        sheet = actions.do_create_price_sheet(request.user, **fields)
    except ValidationError as error:
        messages.error(request, "Not saved: " + errors_text(error))
        # Keep what was typed, within reason, for the form shown after the redirect.
        request.session["price_form"] = {k: str(v)[:200] for k, v in request.POST.items()}
        return redirect("console-prices")
    messages.info(
        request,
        f"Price sheet for {sheet.model}{'/' + sheet.adapter if sheet.adapter else ''} "
        f"({sheet.tenant.slug if sheet.tenant else 'list price'}) in force from "
        f"{sheet.effective_from:%Y-%m-%d %H:%M} UTC.",
    )
    return redirect("console-prices")


@staff_required
@require_POST
def delete_price_sheet(request: HttpRequest, sheet_id: int) -> HttpResponse:
    """Only a sheet not yet in force: one that has been has priced requests, and a later
    sheet supersedes it instead."""
    sheet = actions.access_price_sheets(request.user).filter(pk=sheet_id).first()
    if sheet is None:
        raise Http404("No such price sheet.")
    if sheet.effective_from <= timezone.now():
        messages.error(
            request,
            "Not deleted: this sheet has been in force and priced requests; "
            "add a new sheet to supersede it.",
        )
        return redirect("console-prices")
    actions.do_delete_price_sheet(sheet, request.user)
    messages.info(request, f"Scheduled price sheet for {sheet.model} deleted.")
    return redirect("console-prices")


# ------------------------------------------------------------------------------ budgets

BUDGET_FIELDS = ("monthly_spend_budget_usd", "monthly_token_budget")


@staff_required
def budgets_page(request: HttpRequest) -> HttpResponse:
    rows = [
        {"tenant": tenant, **budget_figures(tenant)}
        for tenant in Tenant.objects.select_related("quota").order_by("slug")
    ]
    return render(request, "console/budgets.html", {"rows": rows})


@staff_required
def budget_page(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_actions.access_tenant_for_user(request.user, slug)
    quota = tenant_actions.access_quota(request.user, tenant)
    context = {
        "tenant": tenant,
        "quota": quota,
        "alert_percent": round(quota.soft_alert_fraction * 100, 2),
        "form": request.session.pop("budget_form", {}),
        **budget_figures(tenant),
    }
    return render(request, "console/budget.html", context)


def _update_budget(request: HttpRequest, tenant: Tenant, changes: dict[str, Any]) -> None:
    """Validated by the quota API's serializer, written by its action."""
    quota = tenant_actions.access_quota(request.user, tenant)
    tenant_actions.require_staff(request.user)
    serializer = QuotaSerializer(quota, data=changes, partial=True)
    if not serializer.is_valid():
        raise ValidationError(errors_text(serializer.errors))
    tenant_actions.do_update_quota(quota, **dict(serializer.validated_data))


@staff_required
@require_POST
def set_budget(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_actions.access_tenant_for_user(request.user, slug)
    form = request.POST
    changes: dict[str, Any] = {name: form.get(name, "").strip() or None for name in BUDGET_FIELDS}
    changes["hard_budget"] = form.get("hard_budget") == "on"
    try:
        changes["soft_alert_fraction"] = actions.check_alert_percent(
            form.get("soft_alert_percent", "")
        )
        _update_budget(request, tenant, changes)
    except ValidationError as error:
        messages.error(request, "Not saved: " + errors_text(error))
        request.session["budget_form"] = {k: str(v)[:200] for k, v in form.items()}
        return redirect("console-budget", slug=tenant.slug)
    messages.info(request, f"Budget of {tenant.name} saved.")
    return redirect("console-budget", slug=tenant.slug)


@staff_required
@require_POST
def remove_budget(request: HttpRequest, slug: str) -> HttpResponse:
    """No spend and no token budget: the tenant is limited by its rates only, and no budget
    alert is sent."""
    tenant = tenant_actions.access_tenant_for_user(request.user, slug)
    _update_budget(request, tenant, dict.fromkeys(BUDGET_FIELDS))
    messages.info(request, f"Budget of {tenant.name} removed.")
    return redirect("console-budget", slug=tenant.slug)


# -------------------------------------------------------------------------- usage search


class UsageSearch(TimeRangeQuery):
    """The search form: the API's time range ([start, end), 30 days before end by default,
    start before end) and the dimensions an operator narrows by."""

    tenant = serializers.CharField(required=False, max_length=50)
    key = serializers.CharField(required=False, max_length=32, help_text="A key prefix or id.")
    model = serializers.CharField(required=False, max_length=128)
    status = serializers.ChoiceField(choices=STATUSES, required=False)
    before = serializers.CharField(required=False, max_length=120)


SEARCH_FIELDS = ("tenant", "key", "model", "status", "start", "end")


def parse_search(user: Any, data: QueryDict) -> tuple[QuerySet[UsageEvent], dict[str, Any]]:
    """The filtered events, newest first, and the parsed filters; or a ValidationError."""
    search = UsageSearch(data=_given(data, (*SEARCH_FIELDS, "before")))
    if not search.is_valid():
        raise ValidationError(errors_text(search.errors))
    params = dict(search.validated_data)
    events = actions.access_usage(user).filter(
        started_at__gte=params["start"], started_at__lt=params["end"]
    )
    tenant = None
    if "tenant" in params:
        try:
            tenant = tenant_actions.access_tenant_for_user(user, params["tenant"])
        except Http404:
            raise ValidationError({"tenant": "No such tenant."}) from None
        events = events.filter(tenant_id=tenant.pk)
    if "key" in params:
        events = events.filter(key_id=_key_id(params["key"], tenant))
    if "model" in params:
        events = events.filter(model=params["model"])
    if "status" in params:
        events = events.filter(status=params["status"])
    if "before" in params:
        events = events.filter(_before(_cursor(params["before"])))
    return events.order_by(*NEWEST_FIRST), params


def _key_id(text: str, tenant: Tenant | None) -> int:
    """An API key by its prefix (as shown, `sk-abc…` or `abc`) or its id."""
    keys = ApiKey.objects.all() if tenant is None else ApiKey.objects.filter(tenant=tenant)
    prefix = text.removeprefix("sk-").rstrip("-…")
    key = keys.filter(prefix=prefix).first()
    if key is None and (pk := row_id(text)) is not None:
        key = keys.filter(pk=pk).first()
    if key is None:
        raise ValidationError(
            {"key": "No such API key" + (f" of {tenant.slug}." if tenant else ".")}
        )
    return key.pk


def _before(cursor: tuple[datetime, str]) -> Q:
    started_at, request_id = cursor
    return Q(started_at__lt=started_at) | Q(started_at=started_at, request_id__lt=request_id)


def _cursor(text: str) -> tuple[datetime, str]:
    moment, _, request_id = text.partition("|")
    try:
        started_at = parse_datetime(moment)
    except ValueError:
        started_at = None
    if started_at is None or timezone.is_naive(started_at) or not request_id:
        raise ValidationError({"before": "Not a page of this search: start again from the first."})
    return started_at, request_id


def _cursor_of(event: UsageEvent) -> str:
    return f"{event.started_at.isoformat()}|{event.request_id}"


def _names(events: list[UsageEvent]) -> tuple[dict[int, str], dict[int, str]]:
    """The tenants' slugs and the keys' prefixes of these events, in two queries."""
    tenant_ids = {e.tenant_id for e in events}
    key_ids = {e.key_id for e in events if e.key_id is not None}
    slugs = dict(Tenant.objects.filter(pk__in=tenant_ids).values_list("pk", "slug"))
    prefixes = dict(ApiKey.objects.filter(pk__in=key_ids).values_list("pk", "prefix"))
    return slugs, prefixes


@staff_required
def usage_page(request: HttpRequest) -> HttpResponse:
    filters = {name: request.GET.get(name, "")[:200] for name in SEARCH_FIELDS}
    context: dict[str, Any] = {
        "filters": filters,
        "statuses": STATUSES,
        "tenants": Tenant.objects.order_by("slug"),
        "csv_max_rows": CSV_MAX_ROWS,
        "rows": [],
    }
    try:
        events, params = parse_search(request.user, request.GET)
    except ValidationError as error:
        context["error"] = errors_text(error)
    else:
        page = list(events[: PAGE_SIZE + 1])
        shown = page[:PAGE_SIZE]
        slugs, prefixes = _names(shown)
        context["rows"] = [
            {
                "event": e,
                "tenant": slugs.get(e.tenant_id, e.tenant_id),
                "key": prefixes.get(e.key_id or 0, ""),
                "price_usd": micros_to_usd(e.price_charged_usd_micros),
            }
            for e in shown
        ]
        context["start"], context["end"] = params["start"], params["end"]
        given = urlencode(_given(request.GET, SEARCH_FIELDS))
        context["query"] = given
        context["first_page"] = "before" in params
        if len(page) > PAGE_SIZE:
            context["next_query"] = urlencode(
                {**_given(request.GET, SEARCH_FIELDS), "before": _cursor_of(shown[-1])}
            )
    template = "console/usage_results.html" if request.headers.get("HX-Request") else None
    return render(request, template or "console/usage.html", context)


class _Echo:
    """csv.writer's file: each row is handed back to be streamed, nothing is buffered."""

    def write(self, value: str) -> str:
        return value


def _csv_chunks(events: QuerySet[UsageEvent]) -> Iterator[str]:
    """The header, then one chunk of lines per keyset batch of events."""
    writer = csv.writer(_Echo())
    yield writer.writerow(CSV_HEADER)
    sent = 0
    batch_query = events
    while sent < CSV_MAX_ROWS:
        batch = list(batch_query[: min(CSV_BATCH, CSV_MAX_ROWS - sent)])
        if not batch:
            return
        slugs, prefixes = _names(batch)
        yield "".join(
            writer.writerow(
                (
                    e.started_at.isoformat(),
                    e.request_id,
                    slugs.get(e.tenant_id, e.tenant_id),
                    prefixes.get(e.key_id or 0, ""),
                    e.model,
                    e.status,
                    e.prompt_tokens,
                    e.cached_prompt_tokens,
                    e.completion_tokens,
                    "" if e.ttft_ms is None else round(e.ttft_ms, 1),
                    "" if (tpot_ms := e.tpot_ms) is None else round(tpot_ms, 2),
                    e.slo_outcome or "",
                    round(e.total_ms, 1),
                    micros_to_usd(e.price_charged_usd_micros),
                    e.replica_id,
                    e.pool,
                    e.prefill_pool,
                )
            )
            for e in batch
        )
        sent += len(batch)
        # The next batch by keyset from the last row, as the pages are: an index range each.
        batch_query = events.filter(_before((batch[-1].started_at, batch[-1].request_id)))


async def _csv_chunks_async(events: QuerySet[UsageEvent]) -> AsyncIterator[str]:
    """The same chunks for an ASGI server, each batch read on the ORM's thread: given a plain
    iterator, Django's ASGI handler would read the whole export into memory first."""
    chunks = _csv_chunks(events)
    read = sync_to_async(_next_chunk)
    while (chunk := await read(chunks)) is not None:
        yield chunk


def _next_chunk(chunks: Iterator[str]) -> str | None:
    return next(chunks, None)


@staff_required
def usage_csv(request: HttpRequest) -> HttpResponse:
    """The search's events as CSV, newest first, at most CSV_MAX_ROWS of them."""
    try:
        events, params = parse_search(request.user, request.GET)
    except ValidationError as error:
        messages.error(request, "No export: " + errors_text(error))
        return redirect(
            f"{reverse('console-usage')}?{urlencode(_given(request.GET, SEARCH_FIELDS))}"
        )
    chunks = _csv_chunks_async(events) if isinstance(request, ASGIRequest) else _csv_chunks(events)
    response = StreamingHttpResponse(chunks, content_type="text/csv; charset=utf-8")
    name = f"usage-{params['start']:%Y%m%dT%H%M}-{params['end']:%Y%m%dT%H%M}.csv"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    response["X-Rows-Limit"] = str(CSV_MAX_ROWS)
    # staff_required is typed for HttpResponse; a streaming one is served the same way.
    return cast(HttpResponse, response)
