"""The tenant portal's frame and its key pages (members, by role).

Every portal page, whichever app renders it (usage, invoices and models in metering/, the
playground in serving/console/), finds its tenant with `portal_tenant` and builds its context
with `portal_context`; config/urls.py mounts them all under /portal/<slug>/.

Portal lookups go through `access_tenant_for_user`: a tenant the user is not a member of is a
404. Reading needs the viewer role, creating or revoking keys the developer role (403 else).

Every form POSTs, then redirects back to its page, so a refresh creates nothing. A refused
form comes back with its message and what was typed; a new key's secret crosses the redirect
in the session (database-backed; never in a message, whose storage may be a cookie) and is
popped by the page that shows it, once.
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
KEY_NAME_MAX_LENGTH = ApiKey._meta.get_field("name").max_length or 200


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


NEW_KEY_SESSION_KEY = "new_api_key"
KEY_FORM_SESSION_KEY = "refused_api_key_form"


def refusal_text(error: ValidationError) -> str:
    if hasattr(error, "error_dict"):
        return "; ".join(
            f"{field.replace('_', ' ')}: {message}"
            for field, field_messages in error.message_dict.items()
            for message in field_messages
        )
    return "; ".join(error.messages)


@login_required
def keys_page(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = portal_tenant(request, slug)
    new_key = request.session.pop(NEW_KEY_SESSION_KEY, None)
    if new_key is not None and new_key.get("tenant") != tenant.slug:
        new_key = None  # created in another tenant's portal: not this page's to show
    keys = ApiKey.objects.filter(tenant=tenant).select_related("created_by")
    context = portal_context(
        request,
        tenant,
        keys=keys,
        scopes=KEY_SCOPES,
        new_key=new_key,
        form=request.session.pop(KEY_FORM_SESSION_KEY, None),
        name_max_length=KEY_NAME_MAX_LENGTH,
        now=timezone.now(),
    )
    response = render(request, "portal/keys.html", context)
    if new_key is not None:
        # Shown once: the page carrying the secret must not be cached anywhere.
        response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def create_key(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = portal_tenant(request, slug, Role.DEVELOPER)
    name = request.POST.get("name", "")
    scopes = request.POST.getlist("scopes") or [Scope.INFERENCE]
    try:
        key, secret = actions.do_create_api_key(tenant, name, request.user, scopes)
    except ValidationError as error:
        messages.error(request, "Key not created: " + refusal_text(error))
        # What was typed comes back in the form, cut to what the field can hold.
        request.session[KEY_FORM_SESSION_KEY] = {
            "name": name[:KEY_NAME_MAX_LENGTH],
            "scopes": [scope for scope in scopes if scope in KEY_SCOPES],
        }
        return redirect("portal-keys", slug=tenant.slug)
    request.session[NEW_KEY_SESSION_KEY] = {
        "tenant": tenant.slug,
        "name": key.name,
        "secret": secret,
    }
    return redirect("portal-keys", slug=tenant.slug)


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
