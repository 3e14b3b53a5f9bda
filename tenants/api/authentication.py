"""`Authorization: Bearer <api key>` on /api for automation.

A key with the `manage` or `read_usage` scope authenticates as an `ApiKeyUser` bound to its
tenant: it sees that tenant only, acting as an admin with `manage` and as a viewer with
`read_usage` alone (see tenants.actions.role_of). Inference-only keys are refused here.

`Authorization: Bearer pst_…`, a staff token (tenants/staff_tokens.py), authenticates as the
staff user who made it, while that user is active and staff and the token unexpired and
unrevoked; a `read` token may only use the safe methods (403 on any other).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils import timezone
from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from tenants.actions import api_key_for_raw_key
from tenants.models import ApiKey, Scope, Tenant
from tenants.staff_token_actions import (
    do_note_staff_token_use,
    staff_token_for_raw_token,
    staff_token_refusal,
)
from tenants.staff_tokens import (
    STAFF_TOKEN_SCHEME,
    STAFF_TOKEN_SEPARATOR,
    StaffToken,
    StaffTokenScope,
)

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


class StaffTokenRefused(exceptions.APIException):
    """401 with `WWW-Authenticate: Bearer`. Not an AuthenticationFailed: DRF answers those
    with the first authenticator's header, and session authentication comes first (so that
    no credentials stays a 403), which would turn a refused token into a 403 too."""

    status_code = 401
    default_detail = "Invalid staff token."
    default_code = "authentication_failed"
    auth_header = "Bearer"


class StaffTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"
    token_start = STAFF_TOKEN_SCHEME + STAFF_TOKEN_SEPARATOR

    def authenticate(self, request: Request) -> tuple[Any, StaffToken] | None:
        header = authentication.get_authorization_header(request).decode(errors="replace")
        scheme, _, raw_token = header.partition(" ")
        if scheme != self.keyword or not raw_token.startswith(self.token_start):
            return None
        token = staff_token_for_raw_token(raw_token.strip())
        if token is None:
            raise StaffTokenRefused()
        now = timezone.now()
        if refusal := staff_token_refusal(token, now):
            raise StaffTokenRefused(refusal)
        do_note_staff_token_use(token, now)
        if token.scope != StaffTokenScope.WRITE and request.method not in permissions.SAFE_METHODS:
            raise exceptions.PermissionDenied(
                "This staff token has the read scope: GET, HEAD and OPTIONS only."
            )
        return token.user, token

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

    class StaffTokenScheme(OpenApiAuthenticationExtension):
        target_class = "tenants.api.authentication.StaffTokenAuthentication"
        name = "staffToken"

        def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
            return {"type": "http", "scheme": "bearer"}

    return ApiKeyScheme, StaffTokenScheme


bearer_scheme_extension()
