"""What both transports check before a generation, the same way: the API key a request
carries, the principal it stands for (usable, with the `inference` scope), and the priority
tier it asks for. HTTP (`serving.gateway.asgi`) and WebSocket (`serving.gateway.websocket`)
both use these; so do the ASGI types they share.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from serving.gateway.errors import ApiError, invalid_api_key
from serving.router.contracts import Tier
from tenants.keys import KeyPrincipal

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PRIORITY_HEADER = "x-priority"
TIERS: tuple[Tier, ...] = ("interactive", "standard", "batch")
_TIER_NAMED: dict[str, Tier] = {tier: tier for tier in TIERS}
_PRIORITY_HEADER_NAME = PRIORITY_HEADER.encode()


class Authenticator(Protocol):
    async def authenticate(self, raw_key: str) -> KeyPrincipal | None: ...


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header (`name` in lowercase, as ASGI gives names)."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def bearer_token(scope: Scope) -> str | None:
    """The key of an `Authorization: Bearer <key>` header."""
    value = header(scope, b"authorization")
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip()
    return None


def api_key(scope: Scope) -> str | None:
    """The key an HTTP request carries: its Bearer token, else an `x-api-key` or `api-key`
    header."""
    token = bearer_token(scope)
    if token is not None:
        return token
    return header(scope, b"x-api-key") or header(scope, b"api-key")


async def authorize(authenticator: Authenticator, raw_key: str | None) -> KeyPrincipal:
    """The principal of a key that may run inference; else the ApiError to answer."""
    principal = await authenticator.authenticate(raw_key) if raw_key else None
    if principal is None:
        raise invalid_api_key()
    if not principal.is_usable:
        raise ApiError(403, "Your tenant is suspended.", code="tenant_suspended")
    if "inference" not in principal.scopes:
        raise ApiError(403, "This API key has no 'inference' scope.", code="missing_scope")
    return principal


def priority_tier(scope: Scope) -> Tier:
    """The tier of the `x-priority` header (standard without one); a 400 for another name."""
    tier = _TIER_NAMED.get((header(scope, _PRIORITY_HEADER_NAME) or "standard").lower())
    if tier is None:
        raise ApiError(
            400, f"{PRIORITY_HEADER} must be one of {', '.join(TIERS)}.", param=PRIORITY_HEADER
        )
    return tier
