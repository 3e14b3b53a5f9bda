"""The tenant portal's key pages (mounted under /portal/ by config/urls.py, beside the
portal pages of metering/ and serving/console/)."""

from django.urls import URLPattern, URLResolver, path

from tenants import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("<slug:slug>/", views.keys_page, name="portal-keys"),
    path("<slug:slug>/keys/create/", views.create_key, name="portal-create-key"),
    path("<slug:slug>/keys/<int:key_id>/revoke/", views.revoke_key, name="portal-revoke-key"),
]
