"""The tenant portal's playground (members): chat with what the tenant can call, through /v1.

The playground's key: the secret of a key is never stored in the database, so the page
cannot reuse one of the member's keys. On demand it issues a short-lived key for the
logged-in member (scope `inference` only, expiring in an hour, named "playground
(<username>)"): one per member, tenant and hour, its secret held in the member's server-side
session so that using the playground again hands back the same key (see
`tenants.actions.do_issue_playground_key`); or the member pastes a key.
"""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_POST
from redis.exceptions import RedisError

from registry.actions import visible_adapters_for_tenant, visible_models_for_tenant
from serving.actions.routing_table import read_routing_table
from tenants import actions
from tenants.models import Role, Tenant
from tenants.views import portal_context, portal_tenant


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


PLAYGROUND_KEYS_SESSION_KEY = "playground_keys"


@login_required
@require_POST
def playground_key(request: HttpRequest, slug: str) -> JsonResponse:
    """The member's playground key for this tenant: the same one while it has time to live
    (its secret is held in the server-side session, per tenant), a new one otherwise."""
    try:
        tenant = portal_tenant(request, slug, Role.DEVELOPER)
    except PermissionDenied as error:
        return JsonResponse({"error": str(error)}, status=403)
    held: dict[str, str] = dict(request.session.get(PLAYGROUND_KEYS_SESSION_KEY) or {})
    key, secret = actions.do_issue_playground_key(tenant, request.user, held.get(tenant.slug))
    held[tenant.slug] = secret
    request.session[PLAYGROUND_KEYS_SESSION_KEY] = held
    assert key.expires_at is not None
    response = JsonResponse({"key": secret, "expires_at": key.expires_at.isoformat()})
    response["Cache-Control"] = "no-store"
    return response
