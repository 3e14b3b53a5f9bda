"""WebSocket routes, gathered from the apps (Channels consumers)."""

from django.urls import URLPattern, URLResolver, path

from serving.console.consumers import FleetLiveConsumer
from serving.gateway.websocket import ChatStreamConsumer

websocket_urlpatterns: list[URLPattern | URLResolver] = [
    path("v1/chat/completions/ws", ChatStreamConsumer.as_asgi()),
    path("console/ws/fleet", FleetLiveConsumer.as_asgi()),
]
