"""The metering app's pages in the tenant portal (mounted under /portal/ by config/urls.py)."""

from django.urls import URLPattern, URLResolver, path

from metering import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("<slug:slug>/models/", views.portal_models, name="portal-models"),
    path("<slug:slug>/usage/", views.portal_usage, name="portal-usage"),
    path("<slug:slug>/invoices/", views.portal_invoices, name="portal-invoices"),
]
