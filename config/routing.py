"""WebSocket routes of the Channels apps (the console's live fleet).

The chat WebSocket of the API (`/v1/chat/completions/ws`) is not here: the gateway's own ASGI
app serves it (`serving.gateway.websocket`), in front of this router.
"""

from django.urls import URLPattern, URLResolver, path

from serving.console.consumers import FleetLiveConsumer

websocket_urlpatterns: list[URLPattern | URLResolver] = [
    path("console/ws/fleet", FleetLiveConsumer.as_asgi()),
]
