"""The tenant portal's playground (members): chat with what the tenant can call, through /v1.

The playground's key: the secret of a key is never stored in clear, so the page cannot reuse
one of the member's keys. On demand it mints a short-lived key for the logged-in member
(scope `inference` only, expiring in an hour, named "playground (<username>)") and hands
the secret to the page once, which keeps it in memory only; or the member pastes a key.
"""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_POST
from redis.exceptions import RedisError

from registry.actions import visible_adapters_for_tenant, visible_models_for_tenant
from serving.actions.routing_table import read_routing_table
from tenants import actions
from tenants.models import Role, Scope, Tenant
from tenants.views import portal_context, portal_tenant

PLAYGROUND_KEY_LIFETIME = timedelta(hours=1)


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
