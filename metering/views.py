"""Console pages of billing, routing and tenants' spend (staff), and the portal's usage,
invoices and models with their prices (members)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.db.models import ExpressionWrapper, F, FloatField
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from prometheus_client import REGISTRY

from config.loops import loop_failures
from config.redis import redis_client
from config.views import staff_required
from metering import actions
from metering.api.queries import MARGIN_PCT_MIN_REVENUE_MICROS, margin_report
from metering.console_queries import daily_series, decisions_by_reason, month_to_date
from metering.models import HourlyRollup, PriceSheet, ReplicaHour
from registry.actions import visible_models_for_tenant
from registry.models import Deployment
from tenants import actions as tenant_actions
from tenants.models import Tenant
from tenants.views import portal_context, portal_tenant

WINDOW = timedelta(days=30)
RECENT_REQUESTS = 50


def margin_reports(since: datetime, now: datetime) -> dict[str, Any]:
    """The margin report by pool, model and tenant over the window, as the API computes it."""
    reports = {
        by: margin_report(HourlyRollup.objects.all(), ReplicaHour.objects.all(), since, now, by)
        for by in ("pool", "model", "tenant")
    }
    return {"totals": reports["pool"]["totals"], "reports": reports}


@staff_required
def billing(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    since = now - WINDOW
    context = {
        **margin_reports(since, now),
        "since": since,
        "invoices": actions.access_invoices(request.user)[:100],
        "sheets": actions.access_price_sheets(request.user).select_related("tenant"),
        "margin_pct_min_revenue_usd": MARGIN_PCT_MIN_REVENUE_MICROS / 1_000_000,
    }
    return render(request, "console/billing.html", context)


def _router_counter() -> list[dict[str, object]]:
    """This process's router decisions (the gateway runs in the same ASGI process)."""
    rows: list[dict[str, object]] = []
    for family in REGISTRY.collect():
        if family.name != "platform_router_decisions":
            continue
        for item in family.samples:
            if item.name.endswith("_total"):
                rows.append({**item.labels, "count": int(item.value)})
    return sorted(rows, key=lambda row: -int(row["count"]))  # type: ignore[call-overload]


@staff_required
def router(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    since = now - WINDOW
    context = {
        **margin_reports(since, now),
        "since": since,
        "decisions": _router_counter(),
        "by_pool": decisions_by_reason(since),
    }
    return render(request, "console/router.html", context)


@login_required
def portal_usage(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = portal_tenant(request, slug)
    recent = (
        actions.access_usage(request.user)
        .filter(tenant_id=tenant.pk)
        .annotate(price_usd=ExpressionWrapper(F("price_charged_usd_micros") / 1e6, FloatField()))
    )
    context = portal_context(
        request,
        tenant,
        recent=recent.order_by("-started_at")[:RECENT_REQUESTS],
        series=daily_series(tenant.pk),
        **budget_figures(tenant),
    )
    return render(request, "portal/usage.html", context)


@login_required
def portal_invoices(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = portal_tenant(request, slug)
    invoices = actions.access_invoices(request.user).filter(tenant=tenant).prefetch_related("lines")
    return render(
        request, "portal/invoices.html", portal_context(request, tenant, invoices=invoices)
    )


def budget_figures(tenant: Tenant) -> dict[str, Any]:
    quota = getattr(tenant, "quota", None)
    usage = month_to_date(tenant.pk)
    budget = (
        float(quota.monthly_spend_budget_usd) if quota and quota.monthly_spend_budget_usd else None
    )
    token_budget = quota.monthly_token_budget if quota else None
    return {
        "usage": usage,
        "spend_budget": budget,
        "spend_pct": usage.spend_usd / budget * 100 if budget else None,
        "token_budget": token_budget,
        "token_pct": usage.tokens / token_budget * 100 if token_budget else None,
    }


@staff_required
def tenants_page(request: HttpRequest) -> HttpResponse:
    rows = [
        {"tenant": tenant, **budget_figures(tenant)}
        for tenant in Tenant.objects.select_related("quota")
    ]
    return render(request, "console/tenants.html", {"rows": rows})


@staff_required
def tenant_detail(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_actions.access_tenant_for_user(request.user, slug)
    context = {
        "tenant": tenant,
        "quota": tenant_actions.access_quota(request.user, tenant),
        "members": tenant.memberships.select_related("user"),
        "keys": tenant.api_keys.all()[:50],
        # The invoice refresh or the budget check failing on this tenant (config.loops).
        "loop_failures": loop_failures(redis_client(), "tenant").get(tenant.pk, []),
        **budget_figures(tenant),
    }
    return render(request, "console/tenant.html", context)


@login_required
def portal_models(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = portal_tenant(request, slug)
    models = list(visible_models_for_tenant(tenant.pk))
    now = timezone.now()
    prices: dict[str, PriceSheet] = {}
    for sheet in PriceSheet.objects.filter(adapter="", effective_from__lte=now).order_by(
        "effective_from"
    ):
        if sheet.tenant_id in (None, tenant.pk):
            # Later sheets win; the tenant's own sheet wins over the list price.
            current = prices.get(sheet.model)
            if current is None or current.tenant_id is None or sheet.tenant_id is not None:
                prices[sheet.model] = sheet
    tiers: dict[str, set[str]] = {}
    for model_name, tier in Deployment.objects.filter(
        status=Deployment.Status.ACTIVE, traffic_weight__gt=0
    ).values_list("model_version__model__name", "slo_tier"):
        tiers.setdefault(model_name, set()).add(tier)
    rows = [
        {"model": m, "price": prices.get(m.name), "tiers": sorted(tiers.get(m.name, ()))}
        for m in models
    ]
    return render(request, "portal/models.html", portal_context(request, tenant, rows=rows))
