"""The console's tenant administration pages (/console/, staff only): create a tenant, change
its settings, suspend or delete it, its members and their roles, its quota, and one key's own
limits, expiry and revocation.

Each form calls the same `do_*` action as the REST API (tenants/api/views.py), so the API and
the console refuse the same input with the same words. Every form POSTs, then redirects to its
page (a refresh repeats nothing). A refused form says why in a message and comes back with what
was typed (kept in the session for the one page view that follows, cut to a field's length),
and the fields it names are marked; nothing is saved.
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from typing import Any

from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import ProtectedError, RestrictedError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_http_methods, require_POST

from config.views import staff_required
from tenants import actions
from tenants.models import (
    ApiKey,
    KeyQuotaOverride,
    Membership,
    PriorityTier,
    Quota,
    Role,
    Tenant,
)
from tenants.views import refusal_text

FORM_SESSION_KEY = "refused_console_tenant_form"
# What comes back into a refused form is cut to this, or to the field's own length.
TYPED_MAX_LENGTH = 500
NAME_MAX_LENGTH = Tenant._meta.get_field("name").max_length or 200
EXPIRY_FORMAT = "%Y-%m-%dT%H:%M"
NOT_FOUND_USER = "No active user has this username or email."

QUOTA_COUNTS = (
    "requests_per_minute",
    "tokens_per_minute",
    "concurrent_streams",
    "max_tokens_cap",
    "max_context_tokens",
)
QUOTA_LABELS = {
    "requests_per_minute": "Requests / minute",
    "tokens_per_minute": "Tokens / minute",
    "concurrent_streams": "Concurrent streams",
    "max_tokens_cap": "Max tokens per request",
    "max_context_tokens": "Max context tokens",
    "monthly_token_budget": "Monthly token budget",
    "monthly_spend_budget_usd": "Monthly spend budget (USD)",
    "soft_alert_fraction": "Alert at fraction of budget",
}
OVERRIDE_COUNTS = tuple(field for field in QUOTA_COUNTS if field in actions.OVERRIDE_FIELDS)


# ---------------------------------------------------------------- refused forms


def _refuse(
    request: HttpRequest, form: str, what: str, error: ValidationError, typed: dict[str, Any]
) -> None:
    """Say why `form` was refused and keep what was typed for the page it redirects to."""
    messages.error(request, f"{what}: {refusal_text(error)}")
    fields = list(error.message_dict) if hasattr(error, "error_dict") else []
    request.session[FORM_SESSION_KEY] = {
        "form": form,
        "invalid": fields,
        "values": {name: _cut(name, value) for name, value in typed.items()},
    }


def _cut(name: str, value: Any) -> Any:
    largest = NAME_MAX_LENGTH if name == "name" else TYPED_MAX_LENGTH
    if isinstance(value, str):
        return value[:largest]
    if isinstance(value, list):
        return [str(item)[:largest] for item in value[:100]]
    return value


def _refused_form(request: HttpRequest, form: str) -> dict[str, Any] | None:
    """What `form` was refused with, once: popped by the page view after the redirect."""
    refused = request.session.get(FORM_SESSION_KEY)
    if not refused or refused.get("form") != form:
        return None
    del request.session[FORM_SESSION_KEY]
    return dict(refused)


def _form_state(
    request: HttpRequest, forms: list[str], current: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """For each form on a page: its values (what was typed, if it was refused; else `current`)
    and the fields the refusal named."""
    state: dict[str, dict[str, Any]] = {}
    for form in forms:
        refused = _refused_form(request, form)
        values = dict(current.get(form, {}))
        if refused is not None:
            values.update(refused["values"])
        state[form] = {"values": values, "invalid": refused["invalid"] if refused else []}
    return state


# ---------------------------------------------------------------- parsing what was typed


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _regions(text: str) -> list[str]:
    return [part.strip() for part in text.replace("\n", ",").split(",") if part.strip()]


def _count(field: str, text: str, *, optional: bool = False) -> int | None:
    text = text.strip()
    if not text and optional:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValidationError({field: "Enter a whole number."}) from None


def _money(field: str, text: str) -> Decimal | None:
    text = text.strip()
    if not text:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValidationError({field: "Enter an amount in dollars, like 250.00."}) from None
    if not value.is_finite():
        raise ValidationError({field: "Enter an amount in dollars, like 250.00."})
    return value


def _fraction(field: str, text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValidationError({field: "Enter a number from 0 to 1."}) from None
    if not math.isfinite(value):
        raise ValidationError({field: "Enter a number from 0 to 1."})
    return value


def _expiry(text: str) -> Any:
    """A datetime-local value in the current time zone; empty = no expiry."""
    text = text.strip()
    if not text:
        return None
    try:
        moment = parse_datetime(text)
    except ValueError:
        moment = None
    if moment is None:
        raise ValidationError({"expires_at": "Enter a date and time, like 2030-01-31T18:00."})
    if timezone.is_naive(moment):
        moment = timezone.make_aware(moment)
    return moment


def _expiry_text(key: ApiKey) -> str:
    if key.expires_at is None:
        return ""
    return timezone.localtime(key.expires_at).strftime(EXPIRY_FORMAT)


# ---------------------------------------------------------------- tenants


def _tenant(request: HttpRequest, slug: str) -> Tenant:
    return actions.access_tenant_for_user(request.user, slug)


def _tenant_context(tenant: Tenant, section: str, **extra: Any) -> dict[str, Any]:
    return {"tenant": tenant, "section": section, **extra}


@staff_required
@require_http_methods(["GET", "POST"])
def create_tenant(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        typed: dict[str, Any] = {
            "slug": request.POST.get("slug", ""),
            "name": request.POST.get("name", ""),
            "allowed_regions": request.POST.get("allowed_regions", ""),
            "allowed_tiers": request.POST.getlist("allowed_tiers"),
            "fail_open": request.POST.get("fail_open") == "on",
        }
        try:
            # Tiers are the quota's: created with the tenant, in one transaction.
            with transaction.atomic():
                tiers = actions.check_tiers(typed["allowed_tiers"])
                tenant = actions.do_create_tenant(
                    typed["slug"],
                    typed["name"],
                    allowed_regions=_regions(typed["allowed_regions"]),
                    fail_open=typed["fail_open"],
                )
                actions.do_update_quota(tenant.quota, allowed_tiers=tiers)
        except ValidationError as error:
            _refuse(request, "create", "Tenant not created", error, typed)
            return redirect("console-tenant-create")
        messages.success(request, f"Tenant {tenant.slug} created.")
        return redirect("console-tenant-settings", slug=tenant.slug)
    forms = _form_state(
        request,
        ["create"],
        {"create": {"allowed_tiers": list(PriorityTier.values), "fail_open": False}},
    )
    context = {"form": forms["create"], "tiers": PriorityTier.values}
    return render(request, "console/tenant_create.html", context)


@staff_required
@require_http_methods(["GET", "POST"])
def tenant_settings(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = _tenant(request, slug)
    if request.method == "POST":
        typed: dict[str, Any] = {
            "name": request.POST.get("name", ""),
            "allowed_regions": request.POST.get("allowed_regions", ""),
            "fail_open": request.POST.get("fail_open") == "on",
            "blocked_patterns": request.POST.get("blocked_patterns", ""),
        }
        try:
            actions.do_update_tenant(
                tenant,
                name=typed["name"],
                allowed_regions=_regions(typed["allowed_regions"]),
                fail_open=typed["fail_open"],
                blocked_patterns=_lines(typed["blocked_patterns"]),
            )
        except ValidationError as error:
            _refuse(request, "settings", "Settings not saved", error, typed)
        else:
            messages.success(request, f"Settings of {tenant.slug} saved.")
        return redirect("console-tenant-settings", slug=tenant.slug)
    current = {
        "settings": {
            "name": tenant.name,
            "allowed_regions": ", ".join(tenant.allowed_regions),
            "fail_open": tenant.fail_open,
            "blocked_patterns": "\n".join(tenant.blocked_patterns),
        }
    }
    forms = _form_state(request, ["settings", "delete"], current)
    context = _tenant_context(tenant, "settings", form=forms["settings"], delete=forms["delete"])
    return render(request, "console/tenant_settings.html", context)


@staff_required
@require_POST
def tenant_status(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = _tenant(request, slug)
    status = request.POST.get("status", "")
    try:
        actions.do_update_tenant(tenant, status=status)
    except ValidationError as error:
        messages.error(request, "Status not changed: " + refusal_text(error))
    else:
        verb = "suspended" if status == Tenant.Status.SUSPENDED else "active again"
        messages.success(request, f"Tenant {tenant.slug} {verb}.")
    return redirect("console-tenant-settings", slug=tenant.slug)


@staff_required
@require_POST
def delete_tenant(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = _tenant(request, slug)
    typed: dict[str, Any] = {"confirm": request.POST.get("confirm", "")}
    if typed["confirm"].strip() != tenant.slug:
        error = ValidationError({"confirm": f"Type the slug, {tenant.slug}, to delete."})
        _refuse(request, "delete", "Tenant not deleted", error, typed)
        return redirect("console-tenant-settings", slug=tenant.slug)
    try:
        actions.do_delete_tenant(tenant)
    except (ProtectedError, RestrictedError) as kept:
        kinds = sorted({str(row._meta.verbose_name_plural) for row in kept.args[1]})
        messages.error(
            request,
            f"Tenant not deleted: it still has {', '.join(kinds)}, which are kept. "
            "Suspend it instead.",
        )
        return redirect("console-tenant-settings", slug=slug)
    messages.success(request, f"Tenant {slug} deleted, and its keys with it.")
    return redirect("console-tenants")


# ---------------------------------------------------------------- members


def _addable_user(identifier: str) -> Any:
    """An active user by username, else by email (only when one user has it)."""
    identifier = identifier.strip()
    users = get_user_model().objects.filter(is_active=True)
    found = users.filter(username=identifier).first() if identifier else None
    if found is None and "@" in identifier:
        by_email = list(users.filter(email__iexact=identifier)[:2])
        found = by_email[0] if len(by_email) == 1 else None
    return found


@staff_required
def tenant_members(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = _tenant(request, slug)
    forms = _form_state(request, ["add-member"], {"add-member": {"role": Role.VIEWER}})
    members = Membership.objects.filter(tenant=tenant).select_related("user")
    context = _tenant_context(
        tenant, "members", members=members, roles=Role.values, form=forms["add-member"]
    )
    return render(request, "console/tenant_members.html", context)


@staff_required
@require_POST
def add_member(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = _tenant(request, slug)
    typed: dict[str, Any] = {
        "user": request.POST.get("user", ""),
        "role": request.POST.get("role", ""),
    }
    try:
        role = actions.check_role(typed["role"])
        account = _addable_user(typed["user"])
        if account is None:
            raise ValidationError({"user": NOT_FOUND_USER})
        actions.do_add_member(tenant, account, role, acting_user=request.user)
    except ValidationError as error:
        _refuse(request, "add-member", "Member not added", error, typed)
    else:
        messages.success(request, f"{account.get_username()} added to {tenant.slug} as {role}.")
    return redirect("console-tenant-members", slug=tenant.slug)


@staff_required
@require_POST
def change_member_role(request: HttpRequest, slug: str, membership_id: int) -> HttpResponse:
    tenant = _tenant(request, slug)
    membership = actions.access_membership(request.user, tenant, membership_id)
    name = membership.user.get_username()
    try:
        actions.do_change_member_role(
            membership, request.POST.get("role", ""), acting_user=request.user
        )
    except ValidationError as error:
        messages.error(request, f"Role of {name} not changed: {refusal_text(error)}")
    else:
        messages.success(request, f"{name} is now {membership.role} of {tenant.slug}.")
    return redirect("console-tenant-members", slug=tenant.slug)


@staff_required
@require_POST
def remove_member(request: HttpRequest, slug: str, membership_id: int) -> HttpResponse:
    tenant = _tenant(request, slug)
    membership = actions.access_membership(request.user, tenant, membership_id)
    name = membership.user.get_username()
    try:
        actions.do_remove_member(membership, acting_user=request.user)
    except ValidationError as error:
        messages.error(request, f"{name} not removed: {refusal_text(error)}")
    else:
        messages.success(request, f"{name} removed from {tenant.slug}.")
    return redirect("console-tenant-members", slug=tenant.slug)


# ---------------------------------------------------------------- quota


def _quota_values(quota: Quota) -> dict[str, Any]:
    return {
        **{field: str(getattr(quota, field)) for field in QUOTA_COUNTS},
        "monthly_token_budget": _blank(quota.monthly_token_budget),
        "monthly_spend_budget_usd": _blank(quota.monthly_spend_budget_usd),
        "soft_alert_fraction": str(quota.soft_alert_fraction),
        "hard_budget": quota.hard_budget,
        "allowed_tiers": list(quota.allowed_tiers),
    }


def _blank(value: Any) -> str:
    return "" if value is None else str(value)


@staff_required
@require_http_methods(["GET", "POST"])
def tenant_quota(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = _tenant(request, slug)
    quota = actions.access_quota(request.user, tenant)
    if request.method == "POST":
        typed: dict[str, Any] = {field: request.POST.get(field, "") for field in QUOTA_LABELS}
        typed["hard_budget"] = request.POST.get("hard_budget") == "on"
        typed["allowed_tiers"] = request.POST.getlist("allowed_tiers")
        try:
            changes: dict[str, Any] = {field: _count(field, typed[field]) for field in QUOTA_COUNTS}
            changes["monthly_token_budget"] = _count(
                "monthly_token_budget", typed["monthly_token_budget"], optional=True
            )
            changes["monthly_spend_budget_usd"] = _money(
                "monthly_spend_budget_usd", typed["monthly_spend_budget_usd"]
            )
            changes["soft_alert_fraction"] = _fraction(
                "soft_alert_fraction", typed["soft_alert_fraction"]
            )
            changes["hard_budget"] = typed["hard_budget"]
            changes["allowed_tiers"] = typed["allowed_tiers"]
            with transaction.atomic():
                actions.do_update_quota(quota, **changes)
        except ValidationError as error:
            _refuse(request, "quota", "Quota not saved", error, typed)
        else:
            messages.success(request, f"Quota of {tenant.slug} saved.")
        return redirect("console-tenant-quota", slug=tenant.slug)
    form = _form_state(request, ["quota"], {"quota": _quota_values(quota)})["quota"]
    context = _tenant_context(
        tenant,
        "quota",
        form=form,
        counts=[
            (field, QUOTA_LABELS[field], form["values"][field], field in form["invalid"])
            for field in QUOTA_COUNTS
        ],
        tiers=PriorityTier.values,
    )
    return render(request, "console/tenant_quota.html", context)


# ---------------------------------------------------------------- one key


def _override_values(override: KeyQuotaOverride) -> dict[str, str]:
    return {field: _blank(getattr(override, field)) for field in OVERRIDE_COUNTS}


def _key_url(key: ApiKey) -> str:
    return reverse("console-tenant-key", kwargs={"slug": key.tenant.slug, "key_id": key.pk})


@staff_required
def tenant_key(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    tenant = _tenant(request, slug)
    key = actions.access_api_key(request.user, tenant, key_id)
    # Read, not made: a page view writes nothing (access_key_override would create the row).
    override = KeyQuotaOverride.objects.filter(api_key=key).first() or KeyQuotaOverride()
    quota = actions.access_quota(request.user, tenant)
    current = {
        "limits": _override_values(override),
        "key": {"name": key.name, "expires_at": _expiry_text(key)},
    }
    forms = _form_state(request, ["limits", "key"], current)
    typed_limits = forms["limits"]
    limits = [
        (
            field,
            QUOTA_LABELS[field],
            getattr(quota, field),
            typed_limits["values"][field],
            field in typed_limits["invalid"],
        )
        for field in OVERRIDE_COUNTS
    ]
    context = _tenant_context(
        tenant,
        "keys",
        key=key,
        limits=limits,
        key_form=forms["key"],
        now=timezone.now(),
        time_zone=timezone.get_current_timezone_name(),
    )
    return render(request, "console/tenant_key.html", context)


@staff_required
@require_POST
def set_key_limits(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    tenant = _tenant(request, slug)
    key = actions.access_api_key(request.user, tenant, key_id)
    typed: dict[str, Any] = {field: request.POST.get(field, "") for field in OVERRIDE_COUNTS}
    try:
        changes = {field: _count(field, typed[field], optional=True) for field in typed}
        # One transaction: a refusal also takes back the override row the lookup made.
        with transaction.atomic():
            override = actions.access_key_override(request.user, tenant, key.pk)
            actions.do_set_key_override(override, **changes)
    except ValidationError as error:
        _refuse(request, "limits", "Key limits not saved", error, typed)
    else:
        messages.success(request, f"Limits of key {key.name} saved.")
    return redirect(_key_url(key))


@staff_required
@require_POST
def edit_key(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    tenant = _tenant(request, slug)
    key = actions.access_api_key(request.user, tenant, key_id)
    typed: dict[str, Any] = {
        "name": request.POST.get("name", ""),
        "expires_at": request.POST.get("expires_at", ""),
    }
    try:
        changes: dict[str, Any] = {"name": typed["name"]}
        # Only a changed expiry is checked: a key that has expired can still be renamed.
        if typed["expires_at"].strip() != _expiry_text(key):
            changes["expires_at"] = _expiry(typed["expires_at"])
        actions.do_update_api_key(key, acting_user=request.user, **changes)
    except ValidationError as error:
        key.refresh_from_db()
        _refuse(request, "key", "Key not saved", error, typed)
    else:
        messages.success(request, f"Key {key.name} saved.")
    return redirect(_key_url(key))


@staff_required
@require_POST
def revoke_key(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    tenant = _tenant(request, slug)
    key = actions.access_api_key(request.user, tenant, key_id)
    actions.do_revoke_api_key(key, request.user)
    messages.success(request, f"Key {key.name} (sk-{key.prefix}-…) revoked.")
    return redirect(_key_url(key))
