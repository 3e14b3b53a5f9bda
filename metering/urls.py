"""Console pages of the metering app (mounted under /console/)."""

from django.urls import URLPattern, URLResolver, path

from metering import console_views, views

urlpatterns: list[URLPattern | URLResolver] = [
    path("billing/", views.billing, name="console-billing"),
    path("router/", views.router, name="console-router"),
    path("tenants/", views.tenants_page, name="console-tenants"),
    path("tenants/<slug:slug>/", views.tenant_detail, name="console-tenant"),
    path("prices/", console_views.prices_page, name="console-prices"),
    path("prices/new/", console_views.create_price_sheet, name="console-price-create"),
    path(
        "prices/<int:sheet_id>/delete/",
        console_views.delete_price_sheet,
        name="console-price-delete",
    ),
    path("budgets/", console_views.budgets_page, name="console-budgets"),
    path("budgets/<slug:slug>/", console_views.budget_page, name="console-budget"),
    path("budgets/<slug:slug>/set/", console_views.set_budget, name="console-budget-set"),
    path("budgets/<slug:slug>/remove/", console_views.remove_budget, name="console-budget-remove"),
    path("usage/", console_views.usage_page, name="console-usage"),
    path("usage/export.csv", console_views.usage_csv, name="console-usage-csv"),
]
