"""REST API routes of staff tokens, mounted under /api/v1/ (apart from tenants/api/urls.py,
whose routes are all tenant-scoped but the tenant list).

staff-tokens/                  your tokens; POST answers the secret once (session only)
staff-tokens/{id}/             read; DELETE revokes
staff-tokens/{id}/revoke/      revoke
"""

from django.urls import URLPattern, URLResolver
from rest_framework.routers import SimpleRouter

from tenants.api.staff_tokens import StaffTokenViewSet

router = SimpleRouter()
router.register(r"staff-tokens", StaffTokenViewSet, basename="staff-token")

urlpatterns: list[URLPattern | URLResolver] = [*router.urls]
