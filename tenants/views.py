"""The tenant portal's frame and its key pages (members, by role).

Every portal page, whichever app renders it (usage, invoices and models in metering/, the
playground in serving/console/), finds its tenant with `portal_tenant` and builds its context
with `portal_context`; config/urls.py mounts them all under /portal/<slug>/.

Portal lookups go through `access_tenant_for_user`: a tenant the user is not a member of is a
404. Reading needs the viewer role, creating or revoking keys the developer role (403 else).
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from tenants import actions
from tenants.models import ApiKey, Role, Scope, Tenant

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
        request,
        tenant,
        keys=keys,
        scopes=KEY_SCOPES,
        new_key=key,
        secret=secret,
        now=timezone.now(),
    )
    # Shown once: the page carrying the secret must not be cached anywhere.
    response = render(request, "portal/keys.html", context)
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def revoke_key(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    tenant = portal_tenant(request, slug, Role.DEVELOPER)
    key = actions.access_api_key(request.user, tenant, key_id)
    try:
        actions.require_key_owner_or_admin(request.user, key)
    except PermissionDenied as refusal:
        messages.error(request, f"Key {key.name} not revoked: {refusal}")
        return redirect("portal-keys", slug=tenant.slug)
    actions.do_revoke_api_key(key, request.user)
    messages.info(request, f"Key {key.name} (sk-{key.prefix}-…) revoked.")
    return redirect("portal-keys", slug=tenant.slug)
