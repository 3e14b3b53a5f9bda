"""ASGI entry point: Channels' ProtocolTypeRouter in front of Django.

HTTP under /v1 (and /metrics) goes to the lean gateway app, the rest to Django. WebSockets
pass the origin check, then the chat socket (`/v1/chat/completions/ws`) goes to the gateway
app and the rest to Channels consumers. In front of all of it: the per-client cap on open
requests, the request-body deadline and /metrics access (config/middleware.py).
"""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()

# Imported after Django is set up: these modules import models.
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import OriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402

from config.gateway import get_gateway  # noqa: E402
from config.middleware import with_edge_guards  # noqa: E402
from config.routing import websocket_urlpatterns  # noqa: E402
from serving.gateway.asgi import GatewayApp  # noqa: E402


class BrowserOriginValidator(OriginValidator):
    """Refuses a browser page from another site; lets API clients (no Origin) through.

    Cross-site WebSocket hijacking rides on a browser's cookies, so a browser's Origin must
    be one of ours. A client without an Origin is not a browser and authenticates with an
    API key on the socket itself.
    """

    def valid_origin(self, parsed_origin: object) -> bool:
        if parsed_origin is None:
            return True
        return bool(super().valid_origin(parsed_origin))


allowed_origins = list(settings.ALLOWED_HOSTS)
if settings.DEBUG:
    allowed_origins += ["localhost", "127.0.0.1", "[::1]"]

# Outermost: the per-client cap, the body deadline and /metrics access (config/middleware.py).
application = with_edge_guards(
    ProtocolTypeRouter(
        {
            "http": GatewayApp(fallback=django_asgi_app, gateway=get_gateway),
            "websocket": BrowserOriginValidator(
                GatewayApp(
                    fallback=AuthMiddlewareStack(URLRouter(websocket_urlpatterns)),
                    gateway=get_gateway,
                ),
                allowed_origins,
            ),
        }
    )
)
