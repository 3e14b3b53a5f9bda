"""Console pages of the metering app (mounted under /console/)."""

from django.urls import URLPattern, URLResolver, path

from metering import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("billing/", views.billing, name="console-billing"),
    path("router/", views.router, name="console-router"),
    path("tenants/", views.tenants_page, name="console-tenants"),
    path("tenants/<slug:slug>/", views.tenant_detail, name="console-tenant"),
]
