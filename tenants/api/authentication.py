"""`Authorization: Bearer <api key>` on /api for automation.

A key with the `manage` or `read_usage` scope authenticates as an `ApiKeyUser` bound to its
tenant: it sees that tenant only, acting as an admin with `manage` and as a viewer with
`read_usage` alone (see tenants.actions.role_of). Inference-only keys are refused here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from tenants.actions import api_key_for_raw_key
from tenants.models import ApiKey, Scope, Tenant

API_SCOPES = {Scope.MANAGE, Scope.READ_USAGE}


class ApiKeyUser:
    """The caller behind an API key: authenticated, never staff, one tenant."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False
    pk = None
    id = None

    def __init__(self, api_key: ApiKey) -> None:
        self.api_key = api_key
        self.username = f"api-key:{api_key.prefix}"

    @property
    def tenant(self) -> Tenant:
        return self.api_key.tenant

    def __str__(self) -> str:
        return self.username

    def has_scope(self, scope: str) -> bool:
        return scope in self.api_key.scopes


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[ApiKeyUser, ApiKey] | None:
        header = authentication.get_authorization_header(request).decode(errors="replace")
        scheme, _, raw_key = header.partition(" ")
        if scheme != self.keyword or not raw_key.startswith("sk-"):
            return None
        key = api_key_for_raw_key(raw_key.strip())
        if key is None or key.is_revoked or _expired(key.expires_at):
            raise exceptions.AuthenticationFailed("Invalid API key.")
        if key.tenant.status != Tenant.Status.ACTIVE:
            raise exceptions.AuthenticationFailed("This tenant is suspended.")
        if not API_SCOPES & set(key.scopes):
            raise exceptions.PermissionDenied("This key has no manage or read_usage scope.")
        return ApiKeyUser(key), key

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


def _expired(expires_at: datetime | None) -> bool:
    return expires_at is not None and expires_at <= timezone.now()


def bearer_scheme_extension() -> Any:
    """drf-spectacular learns the scheme from this class when it is imported."""
    from drf_spectacular.extensions import OpenApiAuthenticationExtension

    class ApiKeyScheme(OpenApiAuthenticationExtension):
        target_class = "tenants.api.authentication.ApiKeyAuthentication"
        name = "apiKey"

        def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
            return {"type": "http", "scheme": "bearer"}

    return ApiKeyScheme


bearer_scheme_extension()
