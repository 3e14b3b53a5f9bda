"""The serving app's pages in the tenant portal (mounted under /portal/ by config/urls.py)."""

from django.urls import URLPattern, URLResolver, path

from serving.console import playground

urlpatterns: list[URLPattern | URLResolver] = [
    path("<slug:slug>/playground/", playground.playground, name="portal-playground"),
    path("<slug:slug>/playground/key/", playground.playground_key, name="portal-playground-key"),
]
