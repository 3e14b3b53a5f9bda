"""The writes (`do_*`) and lookups (`access_*`) of staff API tokens (tenants/staff_tokens.py).

The REST API (tenants/api/staff_tokens.py), the console page (tenants/staff_token_views.py)
and the authentication class (tenants/api/authentication.py) call these and nothing else.
A staff member lists and revokes their own tokens only: another's token is a 404.
"""

from __future__ import annotations

import hmac
import logging
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet
from django.utils import timezone

from config.ids import one_row
from tenants.actions import require_staff
from tenants.keys import generate_raw_key, hash_key, key_prefix_of
from tenants.staff_tokens import (
    LAST_USED_PRECISION,
    MAX_LIFETIME,
    STAFF_TOKEN_SCHEME,
    STAFF_TOKEN_SEPARATOR,
    STAFF_TOKEN_SHAPE,
    StaffToken,
    StaffTokenScope,
)

logger = logging.getLogger(__name__)

NAME_MAX_LENGTH = StaffToken._meta.get_field("name").max_length or 100


def check_staff_token(name: str, scope: str, expires_at: datetime | None, now: datetime) -> str:
    """The token's name, stripped; a ValidationError naming each field that is wrong."""
    errors: dict[str, str] = {}
    name = name.strip()
    if not name:
        errors["name"] = "Name the token after what uses it (e.g. ci-deploy)."
    elif len(name) > NAME_MAX_LENGTH:
        errors["name"] = f"Ensure this field has no more than {NAME_MAX_LENGTH} characters."
    if scope not in StaffTokenScope.values:
        errors["scope"] = f"Choose from {', '.join(StaffTokenScope.values)}."
    if expires_at is None:
        errors["expires_at"] = "A staff token must expire: give expires_at."
    elif expires_at <= now:
        errors["expires_at"] = "Must be in the future."
    elif expires_at > now + MAX_LIFETIME:
        errors["expires_at"] = f"At most {MAX_LIFETIME.days} days from now."
    if errors:
        raise ValidationError(errors)
    return name


def do_create_staff_token(
    user: Any, name: str, scope: str, expires_at: datetime
) -> tuple[StaffToken, str]:
    """Create a token for `user`; the secret is returned here once and stored as its SHA-256."""
    require_staff(user)
    name = check_staff_token(name, scope, expires_at, timezone.now())
    raw_token, prefix = generate_raw_key(STAFF_TOKEN_SCHEME, STAFF_TOKEN_SEPARATOR)
    token = StaffToken.objects.create(
        user=user,
        name=name,
        prefix=prefix,
        secret_hash=hash_key(raw_token),
        scope=scope,
        expires_at=expires_at,
    )
    logger.info("Staff token %s (%s, %s) created for %s", token.pk, token.display, scope, user)
    return token, raw_token


def do_revoke_staff_token(token: StaffToken, acting_user: Any) -> StaffToken:
    """Revoke for good; the next request with it is refused (nothing caches a token)."""
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        logger.info("Staff token %s (%s) revoked by %s", token.pk, token.display, acting_user)
    return token


def staff_tokens_for_user(user: Any) -> QuerySet[StaffToken]:
    require_staff(user)
    return StaffToken.objects.filter(user=user)


def access_staff_token(user: Any, token_id: int | str) -> StaffToken:
    """One of the caller's own tokens; anyone else's, or none, is a 404."""
    token: StaffToken = one_row(staff_tokens_for_user(user), token_id, "token")
    return token


def staff_token_for_raw_token(raw_token: str) -> StaffToken | None:
    """The token row a raw token names (with its user), compared in constant time."""
    prefix = key_prefix_of(raw_token, STAFF_TOKEN_SHAPE)
    if prefix is None:
        return None
    token = StaffToken.objects.select_related("user").filter(prefix=prefix).first()
    if token is None or not hmac.compare_digest(token.secret_hash, hash_key(raw_token)):
        return None
    return token


def staff_token_refusal(token: StaffToken, now: datetime) -> str | None:
    """Why the token may not be used now, or None when it may."""
    if token.is_revoked:
        return "This staff token has been revoked."
    if token.expires_at <= now:
        return "This staff token has expired."
    if not (token.user.is_active and token.user.is_staff):
        return "This staff token's user is no longer active staff."
    return None


def do_note_staff_token_use(token: StaffToken, now: datetime) -> None:
    """`last_used_at`, written at most once a `LAST_USED_PRECISION` per token. The UPDATE is
    conditional, so requests arriving together write it once."""
    stale = now - LAST_USED_PRECISION
    if token.last_used_at is not None and token.last_used_at > stale:
        return
    StaffToken.objects.filter(
        Q(last_used_at__isnull=True) | Q(last_used_at__lte=stale), pk=token.pk
    ).update(last_used_at=now)
    token.last_used_at = now
