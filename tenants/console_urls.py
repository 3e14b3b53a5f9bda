"""Console pages of the tenants app (mounted under /console/ by config/urls.py)."""

from django.urls import URLPattern, URLResolver, path

from tenants import staff_token_views as views

urlpatterns: list[URLPattern | URLResolver] = [
    path("tokens/", views.staff_tokens_page, name="console-staff-tokens"),
    path("tokens/create/", views.create_staff_token, name="console-create-staff-token"),
    path(
        "tokens/<int:token_id>/revoke/",
        views.revoke_staff_token,
        name="console-revoke-staff-token",
    ),
]
