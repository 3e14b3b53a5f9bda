"""WebSocket routes, gathered from the apps (Channels consumers)."""

from django.urls import URLPattern, URLResolver, path

from serving.console_consumers import FleetLiveConsumer
from serving.consumers import ChatStreamConsumer

websocket_urlpatterns: list[URLPattern | URLResolver] = [
    path("v1/chat/completions/ws", ChatStreamConsumer.as_asgi()),
    path("console/ws/fleet", FleetLiveConsumer.as_asgi()),
]
