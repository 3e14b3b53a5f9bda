"""WebSocket routes, gathered from the apps (Channels consumers)."""

from django.urls import URLPattern, URLResolver

websocket_urlpatterns: list[URLPattern | URLResolver] = []
