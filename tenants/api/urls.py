"""REST API routes of the tenants app, mounted under /api/v1/.

tenants/                                  list (yours; staff: all), create (staff)
tenants/{slug}/                           read (members), change, delete (staff)
tenants/{slug}/members/[{id}/]            members and roles
tenants/{slug}/keys/[{id}/]               API keys; POST answers the secret once
tenants/{slug}/keys/{id}/revoke/          revoke (DELETE on the key does the same)
tenants/{slug}/keys/{id}/limits/          the key's own tighter limits
tenants/{slug}/quota/                     the tenant's quota
"""

from django.urls import URLPattern, URLResolver, path
from rest_framework.routers import SimpleRouter

from tenants.api.views import ApiKeyViewSet, MembershipViewSet, QuotaViewSet, TenantViewSet

TENANT = r"tenants/(?P<tenant_slug>[-a-zA-Z0-9_]+)"

router = SimpleRouter()
router.register(r"tenants", TenantViewSet, basename="tenant")
router.register(rf"{TENANT}/members", MembershipViewSet, basename="tenant-member")
router.register(rf"{TENANT}/keys", ApiKeyViewSet, basename="tenant-key")

quota = QuotaViewSet.as_view({"get": "retrieve", "put": "update", "patch": "update"})

urlpatterns: list[URLPattern | URLResolver] = [
    path("tenants/<slug:tenant_slug>/quota/", quota, name="tenant-quota"),
    *router.urls,
]
