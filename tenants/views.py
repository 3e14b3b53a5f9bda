"""Console pages of tenants (staff) and the tenant portal (members, by role).

Portal lookups go through `access_tenant_for_user`: a tenant the user is not a member of is a
404. Reading needs the viewer role, creating or revoking keys the developer role (403 else).

The playground's key: the secret of a key is never stored in clear, so the page cannot reuse
one of the member's keys. On demand it mints a short-lived key for the logged-in member
(scope `inference` only, expiring in an hour, named "playground (<username>)") and hands
the secret to the page once, which keeps it in memory only; or the member pastes a key.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST
from redis.exceptions import RedisError

from config.views import staff_required
from metering.console_queries import month_to_date
from metering.models import PriceSheet
from registry.actions import visible_adapters_for_tenant, visible_models_for_tenant
from registry.models import Deployment
from serving.actions.routing_table import read_routing_table
from tenants import actions
from tenants.models import ApiKey, Role, Scope, Tenant

PLAYGROUND_KEY_LIFETIME = timedelta(hours=1)
KEY_SCOPES = [Scope.INFERENCE, Scope.READ_USAGE]


def portal_tenant(request: HttpRequest, slug: str, minimum: str = Role.VIEWER) -> Tenant:
    tenant = actions.access_tenant_for_user(request.user, slug)
    actions.require_role(request.user, tenant, minimum)
    return tenant


def portal_context(request: HttpRequest, tenant: Tenant, **extra: Any) -> dict[str, Any]:
    return {
        "portal_tenant": tenant,
        "role": actions.role_of(request.user, tenant) or ("staff" if request.user.is_staff else ""),
        "can_develop": actions.has_role(request.user, tenant, Role.DEVELOPER),
        **extra,
    }


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


# ---------------------------------------------------------------- console (staff)


@staff_required
def tenants_page(request: HttpRequest) -> HttpResponse:
    rows = [
        {"tenant": tenant, **budget_figures(tenant)}
        for tenant in Tenant.objects.select_related("quota")
    ]
    return render(request, "console/tenants.html", {"rows": rows})


@staff_required
def tenant_detail(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = actions.access_tenant_for_user(request.user, slug)
    context = {
        "tenant": tenant,
        "quota": actions.access_quota(request.user, tenant),
        "members": tenant.memberships.select_related("user"),
        "keys": tenant.api_keys.all()[:50],
        **budget_figures(tenant),
    }
    return render(request, "console/tenant.html", context)


# ---------------------------------------------------------------- portal (members)


@login_required
def keys_page(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = portal_tenant(request, slug)
    keys = ApiKey.objects.filter(tenant=tenant).select_related("created_by")
    return render(
        request,
        "portal/keys.html",
        portal_context(request, tenant, keys=keys, scopes=KEY_SCOPES, now=timezone.now()),
    )


@login_required
@require_POST
def create_key(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = portal_tenant(request, slug, Role.DEVELOPER)
    name = request.POST.get("name", "").strip() or "unnamed key"
    scopes = request.POST.getlist("scopes") or [Scope.INFERENCE]
    try:
        key, secret = actions.do_create_api_key(tenant, name, request.user, scopes)
    except ValidationError as error:
        messages.error(request, "; ".join(error.messages))
        return redirect("portal-keys", slug=tenant.slug)
    keys = ApiKey.objects.filter(tenant=tenant).select_related("created_by")
    context = portal_context(
        request, tenant, keys=keys, scopes=KEY_SCOPES, new_key=key, secret=secret,
        now=timezone.now(),
    )  # fmt: skip
    # Shown once: the page carrying the secret must not be cached anywhere.
    response = render(request, "portal/keys.html", context)
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def revoke_key(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    tenant = portal_tenant(request, slug, Role.DEVELOPER)
    key = actions.access_api_key(request.user, tenant, key_id)
    actions.do_revoke_api_key(key, request.user)
    messages.info(request, f"Key {key.name} (sk-{key.prefix}-…) revoked.")
    return redirect("portal-keys", slug=tenant.slug)


@login_required
def models_page(request: HttpRequest, slug: str) -> HttpResponse:
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


@login_required
def playground(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = portal_tenant(request, slug)
    models = playground_models(tenant)
    return render(request, "portal/playground.html", portal_context(request, tenant, models=models))


def playground_models(tenant: Tenant) -> list[str]:
    """What the tenant can call right now: visible models that are deployed, then the visible
    adapters of those (called by their own name, as with vLLM)."""
    try:
        table = read_routing_table() or {}
    except RedisError:
        table = {}
    deployed = set((table.get("models") or {}).keys())
    models = [m.name for m in visible_models_for_tenant(tenant.pk) if m.name in deployed]
    adapters = [
        a.name
        for a in visible_adapters_for_tenant(tenant.pk).select_related("base_version__model")
        if a.base_version.model.name in deployed
    ]
    return models + adapters


@login_required
@require_POST
def playground_key(request: HttpRequest, slug: str) -> JsonResponse:
    try:
        tenant = portal_tenant(request, slug, Role.DEVELOPER)
    except PermissionDenied as error:
        return JsonResponse({"error": str(error)}, status=403)
    expires_at = timezone.now() + PLAYGROUND_KEY_LIFETIME
    _, secret = actions.do_create_api_key(
        tenant,
        f"playground ({request.user.get_username()})",
        request.user,
        [Scope.INFERENCE],
        expires_at=expires_at,
    )
    response = JsonResponse({"key": secret, "expires_at": expires_at.isoformat()})
    response["Cache-Control"] = "no-store"
    return response
