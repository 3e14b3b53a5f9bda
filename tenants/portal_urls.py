"""The tenant portal (mounted under /portal/): one tenant's keys, models, usage, invoices and
playground, for its members."""

from django.urls import URLPattern, URLResolver, path

from metering import views as metering_views
from tenants import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("<slug:slug>/", views.keys_page, name="portal-keys"),
    path("<slug:slug>/keys/create/", views.create_key, name="portal-create-key"),
    path("<slug:slug>/keys/<int:key_id>/revoke/", views.revoke_key, name="portal-revoke-key"),
    path("<slug:slug>/models/", views.models_page, name="portal-models"),
    path("<slug:slug>/usage/", metering_views.portal_usage, name="portal-usage"),
    path("<slug:slug>/invoices/", metering_views.portal_invoices, name="portal-invoices"),
    path("<slug:slug>/playground/", views.playground, name="portal-playground"),
    path("<slug:slug>/playground/key/", views.playground_key, name="portal-playground-key"),
]
