"""Console pages of the tenants app (mounted under /console/)."""

from django.urls import URLPattern, URLResolver, path

from tenants import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("tenants/", views.tenants_page, name="console-tenants"),
    path("tenants/<slug:slug>/", views.tenant_detail, name="console-tenant"),
]
