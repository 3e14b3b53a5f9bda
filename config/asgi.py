"""ASGI entry point: Channels' ProtocolTypeRouter in front of Django.

HTTP under /v1 (and /metrics) goes to the lean gateway app, the rest to Django; WebSockets
go to Channels consumers.
"""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()

# Imported after Django is set up: these modules import models.
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from config.routing import websocket_urlpatterns  # noqa: E402
from serving.gateway.asgi import GatewayApp  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": GatewayApp(fallback=django_asgi_app),
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)
