"""Django admin registrations of the tenants app. Keys are read-only here: they are created
and revoked through tenants.actions so their Redis records follow."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from tenants.models import ApiKey, KeyQuotaOverride, Membership, Quota, Tenant


class MembershipInline(admin.TabularInline[Membership, Tenant]):
    model = Membership
    extra = 0


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin[Tenant]):
    list_display = ["slug", "name", "status", "fail_open", "created_at"]
    list_filter = ["status"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    list_display = ["name", "prefix", "tenant", "revoked_at", "last_used_at", "created_at"]
    list_filter = ["tenant"]
    exclude = ["secret_hash"]
    readonly_fields = [f.name for f in ApiKey._meta.fields if f.name != "secret_hash"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


admin.site.register(Quota)
admin.site.register(KeyQuotaOverride)
