"""Console pages of the tenants app (mounted under /console/ by config/urls.py): staff tokens,
and the administration of tenants (tenants/console_views.py).

metering.urls, mounted first, owns tenants/ and tenants/<slug>/ (the list and the detail
page, with cost): so a new tenant's form is at new-tenant/, not at tenants/new/, which would
read as the tenant "new".
"""

from django.urls import URLPattern, URLResolver, path

from tenants import console_views as tenant_views
from tenants import staff_token_views as views

TENANT = "tenants/<slug:slug>"
KEY = f"{TENANT}/keys/<int:key_id>"
MEMBER = f"{TENANT}/members/<int:membership_id>"

urlpatterns: list[URLPattern | URLResolver] = [
    path("tokens/", views.staff_tokens_page, name="console-staff-tokens"),
    path("tokens/create/", views.create_staff_token, name="console-create-staff-token"),
    path(
        "tokens/<int:token_id>/revoke/",
        views.revoke_staff_token,
        name="console-revoke-staff-token",
    ),
    path("new-tenant/", tenant_views.create_tenant, name="console-tenant-create"),
    path(f"{TENANT}/settings/", tenant_views.tenant_settings, name="console-tenant-settings"),
    path(f"{TENANT}/status/", tenant_views.tenant_status, name="console-tenant-status"),
    path(f"{TENANT}/delete/", tenant_views.delete_tenant, name="console-tenant-delete"),
    path(f"{TENANT}/members/", tenant_views.tenant_members, name="console-tenant-members"),
    path(f"{TENANT}/members/add/", tenant_views.add_member, name="console-tenant-member-add"),
    path(f"{MEMBER}/role/", tenant_views.change_member_role, name="console-tenant-member-role"),
    path(f"{MEMBER}/remove/", tenant_views.remove_member, name="console-tenant-member-remove"),
    path(f"{TENANT}/quota/", tenant_views.tenant_quota, name="console-tenant-quota"),
    path(f"{KEY}/", tenant_views.tenant_key, name="console-tenant-key"),
    path(f"{KEY}/limits/", tenant_views.set_key_limits, name="console-tenant-key-limits"),
    path(f"{KEY}/edit/", tenant_views.edit_key, name="console-tenant-key-edit"),
    path(f"{KEY}/revoke/", tenant_views.revoke_key, name="console-tenant-key-revoke"),
]
