"""Django admin registrations of the tenants app. Every write goes through tenants.actions,
as the API's and the console's do, so the checks they make (RE2 for blocked patterns, the
regions, the tiers) show on the form, and the keys' Redis records follow at once: a tenant
suspended here is refused by the gateways on commit, not at the next five-minute
republish. Keys are read-only here, never deleted: they are created and revoked through the
actions. Tenants are deleted and members managed through the console and the API."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.http import HttpRequest

from config.admin import ReadOnlyInline
from tenants import actions
from tenants.models import ApiKey, KeyQuotaOverride, Membership, Quota, Tenant


class MembershipInline(ReadOnlyInline):
    """Shown; members are added, changed and removed in the console and the API, whose
    actions keep an owner on every tenant."""

    model = Membership


class TenantAdminForm(forms.ModelForm[Tenant]):
    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or self.cleaned_data
        checks = {
            "allowed_regions": actions.check_regions,
            "blocked_patterns": actions.check_patterns,
            "status": actions.check_status,
        }
        for name, check in checks.items():
            if name in cleaned and cleaned[name] is not None:
                try:
                    cleaned[name] = check(cleaned[name])
                except ValidationError as error:
                    self.add_error(None, error)  # a dict by field: each on its field
        return cleaned


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin[Tenant]):
    form = TenantAdminForm
    list_display = ["slug", "name", "status", "fail_open", "created_at"]
    list_filter = ["status"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]

    def get_readonly_fields(self, request: HttpRequest, obj: Tenant | None = None) -> Any:
        # A slug is in URLs, key records and invoices: chosen once, as on the API.
        return ["slug"] if obj is not None else []

    def has_delete_permission(self, request: HttpRequest, obj: Tenant | None = None) -> bool:
        return False  # the API's delete tombstones the tenant's keys at the gateways

    def save_model(self, request: HttpRequest, obj: Tenant, form: Any, change: bool) -> None:
        data = form.cleaned_data
        if not change:
            created = actions.do_create_tenant(
                obj.slug,
                obj.name,
                allowed_regions=data.get("allowed_regions") or [],
                fail_open=bool(data.get("fail_open")),
                blocked_patterns=data.get("blocked_patterns") or [],
                status=data.get("status") or Tenant.Status.ACTIVE,
            )
            obj.pk, obj.created_at = created.pk, created.created_at
            obj._state.adding = False
            return
        changes = {name: data[name] for name in form.changed_data if name in actions.TENANT_FIELDS}
        if changes:
            actions.do_update_tenant(Tenant.objects.get(pk=obj.pk), **changes)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    list_display = ["name", "prefix", "tenant", "revoked_at", "last_used_at", "created_at"]
    list_filter = ["tenant"]
    exclude = ["secret_hash"]
    readonly_fields = [f.name for f in ApiKey._meta.fields if f.name != "secret_hash"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: ApiKey | None = None) -> bool:
        return False  # a deleted row left its Redis record live: revoke it instead


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin[Quota]):
    """Each tenant's one quota, made with the tenant and gone with it."""

    list_display = ["tenant", "requests_per_minute", "tokens_per_minute", "hard_budget"]
    readonly_fields = ["tenant"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Quota | None = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Quota, form: Any, change: bool) -> None:
        changes = {
            name: form.cleaned_data[name]
            for name in form.changed_data
            if name in actions.QUOTA_FIELDS
        }
        if changes:
            actions.do_update_quota(Quota.objects.get(pk=obj.pk), **changes)


@admin.register(KeyQuotaOverride)
class KeyQuotaOverrideAdmin(admin.ModelAdmin[KeyQuotaOverride]):
    list_display = ["api_key", "requests_per_minute", "tokens_per_minute"]

    def get_readonly_fields(self, request: HttpRequest, obj: KeyQuotaOverride | None = None) -> Any:
        return ["api_key"] if obj is not None else []  # an override stays its key's

    def save_model(
        self, request: HttpRequest, obj: KeyQuotaOverride, form: Any, change: bool
    ) -> None:
        changes = {
            name: form.cleaned_data[name]
            for name in form.changed_data
            if name in actions.OVERRIDE_FIELDS
        }
        target = KeyQuotaOverride.objects.get(pk=obj.pk) if change else obj
        actions.do_set_key_override(target, **changes)
        obj.pk = target.pk

    def delete_model(self, request: HttpRequest, obj: KeyQuotaOverride) -> None:
        key_id = obj.api_key_id
        super().delete_model(request, obj)
        actions.republish_keys([key_id])

    def delete_queryset(self, request: HttpRequest, queryset: Any) -> None:
        key_ids = list(queryset.values_list("api_key_id", flat=True))
        super().delete_queryset(request, queryset)
        actions.republish_keys(key_ids)
