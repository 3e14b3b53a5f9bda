"""REST API routes of the metering app, mounted under /api/v1/.

tenants/{slug}/usage/                         usage series (?start, end, model, key, granularity)
tenants/{slug}/usage/events/                  the raw usage events, newest first (cursor pages)
tenants/{slug}/rollups/                       the tenant's hourly rollups
tenants/{slug}/invoices/[{id}/]               invoices; the detail carries the lines
tenants/{slug}/invoices/{id}/export.csv       the invoice as CSV
tenants/{slug}/invoices/{id}/export.json      the invoice as JSON
rollups/                                      every tenant's rollups (staff)
invoices/close/                               POST {tenant, month}: finalize, idempotent (staff)
chargeback/export.csv?month=YYYY-MM           a month's invoices per team (staff)
price-sheets/[{id}/]                          read (visible models); write (staff)
margin/                                       revenue - cost to serve, idle included, and the
                                              saving against least load, by model, pool or
                                              tenant (staff)
margin/export.csv                             the same report as CSV (staff)

This app's routes are the last of the apps' under /api/v1/ (config/urls.py), so they end
with the API's fallback: any other path ending in a slash, but for schema/ and docs/ (routed
after), is DRF's JSON 404 rather than Django's HTML page. A path without its slash still
gets Django's redirect to the slashed path first (APPEND_SLASH), then that 404.
"""

from django.urls import URLPattern, URLResolver, path, re_path

from config.api import unrouted
from metering.api import views

TENANT = "tenants/<slug:tenant_slug>"
INVOICE = f"{TENANT}/invoices/<int:pk>"

price_sheets = views.PriceSheetViewSet.as_view({"get": "list", "post": "create"})
price_sheet = views.PriceSheetViewSet.as_view(
    {"get": "retrieve", "put": "update", "patch": "partial_update", "delete": "destroy"}
)

urlpatterns: list[URLPattern | URLResolver] = [
    path(
        f"{TENANT}/usage/",
        views.UsageViewSet.as_view({"get": "report"}),
        name="tenant-usage",
    ),
    path(
        f"{TENANT}/usage/events/",
        views.UsageViewSet.as_view({"get": "list"}),
        name="tenant-usage-events",
    ),
    path(
        f"{TENANT}/rollups/",
        views.TenantRollupViewSet.as_view({"get": "list"}),
        name="tenant-rollups",
    ),
    path(
        f"{TENANT}/invoices/",
        views.InvoiceViewSet.as_view({"get": "list"}),
        name="tenant-invoice-list",
    ),
    path(
        f"{INVOICE}/",
        views.InvoiceViewSet.as_view({"get": "retrieve"}),
        name="tenant-invoice-detail",
    ),
    path(
        f"{INVOICE}/export.csv",
        views.InvoiceViewSet.as_view({"get": "export_csv"}),
        name="tenant-invoice-csv",
    ),
    path(
        f"{INVOICE}/export.json",
        views.InvoiceViewSet.as_view({"get": "export_json"}),
        name="tenant-invoice-json",
    ),
    path("rollups/", views.RollupViewSet.as_view({"get": "list"}), name="rollup-list"),
    path(
        "invoices/close/",
        views.CloseMonthViewSet.as_view({"post": "create"}),
        name="invoice-close",
    ),
    path(
        "chargeback/export.csv",
        views.ChargebackViewSet.as_view({"get": "export_csv"}),
        name="chargeback-csv",
    ),
    path("price-sheets/", price_sheets, name="price-sheet-list"),
    path("price-sheets/<int:pk>/", price_sheet, name="price-sheet-detail"),
    path("margin/", views.MarginViewSet.as_view({"get": "report"}), name="margin"),
    path(
        "margin/export.csv",
        views.MarginViewSet.as_view({"get": "export_csv"}),
        name="margin-export-csv",
    ),
    re_path(r"^(?!schema/$|docs/$)(.*/)?$", unrouted, name="api-unrouted"),
]
