"""Every write of the tenants app (`do_*`) and its tenant-scoped lookups (`access_*`).

Views, viewsets, tasks and the demo call these and nothing else. A row of a tenant the
caller does not belong to raises Http404, never 403: its existence is not confirmed.
Staff see every tenant. A request authenticated by an API key acts as a member of the key's
tenant only: `manage` scope as an admin, otherwise as a viewer.

After any change that the gateway caches (a key, its tenant, its quota), the keys' Redis
records are rewritten and an event is published, once the transaction commits.
"""

from __future__ import annotations

import hmac
import logging
import math
from collections.abc import Collection, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.validators import validate_slug
from django.db import transaction
from django.db.models import Model, QuerySet
from django.http import Http404
from django.utils import timezone

from config.ids import one_row, row_id
from config.redis import redis_client
from serving.gateway.guardrails import PatternError, check_blocked_patterns
from tenants.keys import (
    KEY_EVENTS_CHANNEL,
    LAST_USED_HASH,
    EffectiveLimits,
    KeyPrincipal,
    encode_key_record,
    generate_raw_key,
    hash_key,
    key_prefix_of,
    key_record_name,
)
from tenants.models import (
    ROLE_RANK,
    ApiKey,
    KeyQuotaOverride,
    Membership,
    PriorityTier,
    Quota,
    Role,
    Scope,
    Tenant,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- who may do what


def role_of(user: Any, tenant: Tenant) -> str | None:
    """The caller's role in a tenant, or None when not a member."""
    if not getattr(user, "is_authenticated", False):
        return None
    api_key = getattr(user, "api_key", None)
    if api_key is not None:
        if api_key.tenant_id != tenant.pk:
            return None
        return Role.ADMIN if Scope.MANAGE in api_key.scopes else Role.VIEWER
    membership = Membership.objects.filter(user=user, tenant=tenant).only("role").first()
    return membership.role if membership else None


def has_role(user: Any, tenant: Tenant, minimum: str) -> bool:
    if getattr(user, "is_staff", False):
        return True
    role = role_of(user, tenant)
    return role is not None and ROLE_RANK[Role(role)] >= ROLE_RANK[Role(minimum)]


def require_role(user: Any, tenant: Tenant, minimum: str) -> None:
    if not has_role(user, tenant, minimum):
        raise PermissionDenied(f"This needs the {minimum} role in {tenant.slug}.")


def require_key_owner_or_admin(user: Any, key: ApiKey) -> None:
    """Changing or revoking a key: a developer may for the keys they created, an admin (or
    staff) for any key of the tenant. The REST API and the portal both ask this."""
    own = key.created_by_id is not None and key.created_by_id == getattr(user, "pk", None)
    require_role(user, key.tenant, Role.DEVELOPER if own else Role.ADMIN)


def require_staff(user: Any) -> None:
    if not getattr(user, "is_staff", False):
        raise PermissionDenied("Only platform staff may do this.")


# ---------------------------------------------------------------- access_* lookups


def tenants_for_user(user: Any) -> QuerySet[Tenant]:
    if getattr(user, "is_staff", False):
        return Tenant.objects.all()
    api_key = getattr(user, "api_key", None)
    if api_key is not None:
        return Tenant.objects.filter(pk=api_key.tenant_id)
    if not getattr(user, "is_authenticated", False):
        return Tenant.objects.none()
    return Tenant.objects.filter(memberships__user=user)


def access_tenant_for_user(user: Any, tenant_slug_or_id: str | int) -> Tenant:
    tenants = tenants_for_user(user)
    # The slug first: a slug made of digits alone, which slugs no longer may be, stays its
    # own tenant's; then an id, of ASCII digits only (config.ids).
    tenant = None
    if not isinstance(tenant_slug_or_id, int):
        tenant = tenants.filter(slug=tenant_slug_or_id).first()
    if tenant is None and (pk := row_id(tenant_slug_or_id)) is not None:
        tenant = tenants.filter(pk=pk).first()
    if tenant is None:
        raise Http404("No such tenant.")
    return tenant


def access_membership(user: Any, tenant: Tenant, membership_id: int | str) -> Membership:
    access_tenant_for_user(user, tenant.pk)
    members = Membership.objects.select_related("user").filter(tenant=tenant)
    membership: Membership = one_row(members, membership_id, "member")
    return membership


def access_api_key(user: Any, tenant: Tenant, key_id: int | str) -> ApiKey:
    access_tenant_for_user(user, tenant.pk)
    keys = ApiKey.objects.select_related("tenant", "created_by").filter(tenant=tenant)
    key: ApiKey = one_row(keys, key_id, "API key")
    return key


def access_quota(user: Any, tenant: Tenant) -> Quota:
    access_tenant_for_user(user, tenant.pk)
    quota, _ = Quota.objects.get_or_create(tenant=tenant)
    return quota


def access_key_override(user: Any, tenant: Tenant, key_id: int | str) -> KeyQuotaOverride:
    key = access_api_key(user, tenant, key_id)
    override, _ = KeyQuotaOverride.objects.get_or_create(api_key=key)
    return override


# ---------------------------------------------------------------- check_* (bad input)

# A model's served name is at most this long (registry.models.Model.name); tenants sit below
# the registry and cannot import it, so an allowlist is checked for shape, not existence.
MODEL_NAME_MAX_LENGTH = 128


def check_text(model: type[Model], field: str, value: str) -> str:
    """`value` stripped, non-empty and within the model field's max_length; else a
    ValidationError naming the field (a longer value would be a DataError, a 500)."""
    text = value.strip()
    largest = getattr(model._meta.get_field(field), "max_length", None)
    if not text:
        raise ValidationError({field: "Enter a name."})
    if largest is not None and len(text) > largest:
        raise ValidationError({field: f"At most {largest} characters (this one has {len(text)})."})
    return text


def check_tiers(tiers: Iterable[str]) -> list[str]:
    """Priority tiers the gateway accepts (its `x-priority` names; the router ranks the same
    three). An unknown one would lock the tenant out of inference: every request names a tier
    and none would be allowed."""
    chosen = list(dict.fromkeys(tiers))
    unknown = [tier for tier in chosen if tier not in PriorityTier.values]
    if unknown:
        raise ValidationError(
            {
                "allowed_tiers": f"Unknown priority tier {', '.join(map(repr, unknown))}: "
                f"choose from {', '.join(PriorityTier.values)}."
            }
        )
    return chosen


def check_expiry(expires_at: datetime | None) -> datetime | None:
    """An expiry in the future: a key that has already expired would only be listed."""
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationError({"expires_at": "Choose a time in the future."})
    return expires_at


def check_model_allowlist(names: Iterable[str]) -> list[str]:
    chosen = sorted(set(names))
    too_long = [name for name in chosen if len(name) > MODEL_NAME_MAX_LENGTH]
    if too_long:
        raise ValidationError(
            {"model_allowlist": f"A model name has at most {MODEL_NAME_MAX_LENGTH} characters."}
        )
    return chosen


# What the API's serializers allow, so a form's input is held to the same bounds.
REGION_MAX_LENGTH = 64
MAX_REGIONS = 100
PATTERN_MAX_LENGTH = 500
MAX_PATTERNS = 100


def check_new_slug(slug: str) -> str:
    """A slug for a new tenant: letters, digits, hyphens and underscores, within the field's
    length and not taken (it is in URLs, key records and invoices, and never changes)."""
    largest = Tenant._meta.get_field("slug").max_length or 64
    slug = slug.strip()
    if not slug:
        raise ValidationError({"slug": "Enter a slug."})
    if len(slug) > largest:
        raise ValidationError({"slug": f"At most {largest} characters (this one has {len(slug)})."})
    try:
        validate_slug(slug)
    except ValidationError:
        raise ValidationError(
            {"slug": "Use only letters, digits, hyphens and underscores."}
        ) from None
    if Tenant.objects.filter(slug=slug).exists():
        raise ValidationError({"slug": "A tenant with this slug already exists."})
    return slug


def check_regions(regions: Iterable[str]) -> list[str]:
    chosen = list(dict.fromkeys(region.strip() for region in regions))
    if any(not region for region in chosen):
        raise ValidationError({"allowed_regions": "A region name cannot be empty."})
    if any(len(region) > REGION_MAX_LENGTH for region in chosen):
        raise ValidationError(
            {"allowed_regions": f"A region name has at most {REGION_MAX_LENGTH} characters."}
        )
    if len(chosen) > MAX_REGIONS:
        raise ValidationError({"allowed_regions": f"At most {MAX_REGIONS} regions."})
    return chosen


def check_patterns(patterns: Sequence[str]) -> list[str]:
    """Blocked patterns the gateway can run: RE2's syntax (not Python's `re`), within size;
    each once, as every list of the tenants app is stored (regions, tiers, scopes, models)."""
    chosen = list(dict.fromkeys(patterns))
    if len(chosen) > MAX_PATTERNS:
        raise ValidationError({"blocked_patterns": f"At most {MAX_PATTERNS} patterns."})
    if any(len(pattern) > PATTERN_MAX_LENGTH for pattern in chosen):
        raise ValidationError(
            {"blocked_patterns": f"A pattern has at most {PATTERN_MAX_LENGTH} characters."}
        )
    try:
        check_blocked_patterns(chosen)
    except PatternError as error:
        raise ValidationError({"blocked_patterns": str(error)}) from None
    return chosen


def check_status(status: str) -> str:
    if status not in Tenant.Status.values:
        raise ValidationError(
            {"status": f"Choose from {', '.join(Tenant.Status.values)} (not {status!r})."}
        )
    return status


def check_role(role: str) -> Role:
    if role not in Role.values:
        raise ValidationError({"role": f"Choose from {', '.join(Role.values)} (not {role!r})."})
    return Role(role)


# ---------------------------------------------------------------- tenants


@transaction.atomic
def do_create_tenant(
    slug: str,
    name: str,
    *,
    allowed_regions: Sequence[str] = (),
    fail_open: bool = False,
    blocked_patterns: Sequence[str] = (),
    status: str = Tenant.Status.ACTIVE,
    owner: Any = None,
) -> Tenant:
    tenant = Tenant.objects.create(
        slug=check_new_slug(slug),
        name=check_text(Tenant, "name", name),
        allowed_regions=check_regions(allowed_regions),
        fail_open=fail_open,
        blocked_patterns=check_patterns(blocked_patterns),
        status=check_status(status),
    )
    Quota.objects.create(tenant=tenant)
    if owner is not None:
        Membership.objects.create(user=owner, tenant=tenant, role=Role.OWNER)
    return tenant


TENANT_FIELDS = {"name", "status", "allowed_regions", "fail_open", "blocked_patterns"}


@transaction.atomic
def do_update_tenant(tenant: Tenant, **changes: Any) -> Tenant:
    _check_fields(changes, TENANT_FIELDS)
    if "name" in changes:
        changes["name"] = check_text(Tenant, "name", changes["name"])
    if "status" in changes:
        changes["status"] = check_status(changes["status"])
    if "allowed_regions" in changes:
        changes["allowed_regions"] = check_regions(changes["allowed_regions"])
    if "blocked_patterns" in changes:
        changes["blocked_patterns"] = check_patterns(changes["blocked_patterns"])
    for name, value in changes.items():
        setattr(tenant, name, value)
    tenant.save(update_fields=list(changes))
    republish_tenant_keys(tenant.pk)
    return tenant


@transaction.atomic
def do_delete_tenant(tenant: Tenant) -> None:
    keys = list(ApiKey.objects.filter(tenant=tenant))
    tombstones: list[tuple[str, KeyPrincipal | None]] = [(key.secret_hash, None) for key in keys]
    tenant_id = tenant.pk
    tenant.delete()
    transaction.on_commit(lambda: _write_records(tombstones, [f"tenant:{tenant_id}"]))


# ---------------------------------------------------------------- members


@transaction.atomic
def do_add_member(tenant: Tenant, user: Any, role: str, *, acting_user: Any) -> Membership:
    role = check_role(role)
    if role == Role.OWNER:
        require_role(acting_user, tenant, Role.OWNER)
    if Membership.objects.filter(tenant=tenant, user=user).exists():
        raise ValidationError({"user": "Already a member of this tenant."})
    return Membership.objects.create(tenant=tenant, user=user, role=Role(role))


@transaction.atomic
def do_change_member_role(membership: Membership, role: str, *, acting_user: Any) -> Membership:
    role = check_role(role)
    if Role.OWNER in (role, membership.role):
        require_role(acting_user, membership.tenant, Role.OWNER)
    if membership.role == Role.OWNER and role != Role.OWNER:
        _keep_an_owner(membership)
    membership.role = Role(role)
    membership.save(update_fields=["role"])
    return membership


@transaction.atomic
def do_remove_member(membership: Membership, *, acting_user: Any) -> None:
    if membership.role == Role.OWNER:
        require_role(acting_user, membership.tenant, Role.OWNER)
        _keep_an_owner(membership)
    membership.delete()


def _keep_an_owner(membership: Membership) -> None:
    owners = Membership.objects.select_for_update().filter(
        tenant=membership.tenant, role=Role.OWNER
    )
    if owners.exclude(pk=membership.pk).count() == 0:
        raise ValidationError({"role": "A tenant keeps at least one owner."})


# ---------------------------------------------------------------- API keys


def check_scopes_for(user: Any, tenant: Tenant, scopes: Iterable[str]) -> list[str]:
    """Valid scopes, none beyond what the creator may do (only admins mint `manage` keys)."""
    chosen = sorted(set(scopes))
    unknown = [scope for scope in chosen if scope not in Scope.values]
    if unknown or not chosen:
        raise ValidationError({"scopes": f"Choose from {', '.join(Scope.values)}."})
    if Scope.MANAGE in chosen and user is not None and not has_role(user, tenant, Role.ADMIN):
        raise PermissionDenied("Only admins and owners may create keys with the manage scope.")
    return chosen


@transaction.atomic
def do_create_api_key(
    tenant: Tenant,
    name: str,
    created_by: Any,
    scopes: Iterable[str],
    model_allowlist: Iterable[str] = (),
    expires_at: datetime | None = None,
    *,
    raw_key: str | None = None,
) -> tuple[ApiKey, str]:
    """Create a key; the secret is returned here once and stored only as its SHA-256.

    `raw_key` recreates a known key (the demo's); normally a fresh one is generated.
    """
    name = check_text(ApiKey, "name", name)
    chosen_scopes = check_scopes_for(created_by, tenant, scopes)
    allowlist = check_model_allowlist(model_allowlist)
    check_expiry(expires_at)
    if raw_key is None:
        raw_key, prefix = generate_raw_key()
    else:
        known_prefix = key_prefix_of(raw_key)
        if known_prefix is None:
            raise ValidationError("Not an API key.")
        prefix = known_prefix
    key = ApiKey.objects.create(
        tenant=tenant,
        name=name,
        prefix=prefix,
        secret_hash=hash_key(raw_key),
        scopes=chosen_scopes,
        model_allowlist=allowlist,
        expires_at=expires_at,
        created_by=created_by if getattr(created_by, "pk", None) else None,
    )
    logger.info("API key %s (sk-%s-…) created for %s", key.pk, prefix, tenant.slug)
    republish_keys([key.pk])
    return key, raw_key


KEY_FIELDS = {"name", "scopes", "model_allowlist", "expires_at"}


@transaction.atomic
def do_update_api_key(key: ApiKey, *, acting_user: Any, **changes: Any) -> ApiKey:
    _check_fields(changes, KEY_FIELDS)
    if key.is_revoked:
        raise ValidationError("A revoked key cannot be changed.")
    if "name" in changes:
        changes["name"] = check_text(ApiKey, "name", changes["name"])
    if "scopes" in changes:
        changes["scopes"] = check_scopes_for(acting_user, key.tenant, changes["scopes"])
    if "model_allowlist" in changes:
        changes["model_allowlist"] = check_model_allowlist(changes["model_allowlist"])
    if "expires_at" in changes and changes["expires_at"] != key.expires_at:
        check_expiry(changes["expires_at"])
    for name, value in changes.items():
        setattr(key, name, value)
    key.save(update_fields=list(changes))
    republish_keys([key.pk])
    return key


PLAYGROUND_KEY_LIFETIME = timedelta(hours=1)
# A held playground key is handed out again only while it has this long left to live.
PLAYGROUND_KEY_MIN_LEFT = timedelta(minutes=10)


def playground_key_name(user: Any) -> str:
    return f"playground ({user.get_username()})"


@transaction.atomic
def do_issue_playground_key(
    tenant: Tenant, user: Any, held_secret: str | None = None
) -> tuple[ApiKey, str]:
    """The member's playground key: one per member, tenant and hour.

    The secret is not stored, so only a caller that still holds it (the member's session)
    gets the same key back, while it has `PLAYGROUND_KEY_MIN_LEFT` to live. Otherwise a new
    key is minted and the member's older playground keys in this tenant are revoked, so the
    key list never fills up with them.
    """
    require_role(user, tenant, Role.DEVELOPER)
    now = timezone.now()
    name = playground_key_name(user)
    held = api_key_for_raw_key(held_secret) if held_secret else None
    if (
        held is not None
        and held.tenant_id == tenant.pk
        and held.created_by_id == user.pk
        and held.name == name
        and not held.is_revoked
        and held.expires_at is not None
        and held.expires_at - now >= PLAYGROUND_KEY_MIN_LEFT
    ):
        return held, str(held_secret)
    older = ApiKey.objects.filter(
        tenant=tenant, created_by=user, name=name, revoked_at__isnull=True
    )
    for stale in older:
        do_revoke_api_key(stale, user)
    return do_create_api_key(
        tenant, name, user, [Scope.INFERENCE], expires_at=now + PLAYGROUND_KEY_LIFETIME
    )


@transaction.atomic
def do_revoke_api_key(key: ApiKey, acting_user: Any) -> ApiKey:
    """Revoke for good; every gateway process drops the key within a second (within a few
    seconds of Redis coming back, when it was unreachable: see `_write_records`)."""
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
        logger.info("API key %s (sk-%s-…) revoked by %s", key.pk, key.prefix, acting_user)
    republish_keys([key.pk])
    return key


# ---------------------------------------------------------------- quotas

# What `do_update_quota` may change, in the order the API shows them.
QUOTA_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "concurrent_streams",
    "max_tokens_cap",
    "max_context_tokens",
    "monthly_token_budget",
    "monthly_spend_budget_usd",
    "soft_alert_fraction",
    "hard_budget",
    "allowed_tiers",
)
OVERRIDE_FIELDS = {
    "requests_per_minute",
    "tokens_per_minute",
    "concurrent_streams",
    "max_tokens_cap",
    "max_context_tokens",
}


@transaction.atomic
def do_update_quota(quota: Quota, **changes: Any) -> Quota:
    _check_fields(changes, QUOTA_FIELDS)
    if "allowed_tiers" in changes:
        changes["allowed_tiers"] = check_tiers(changes["allowed_tiers"])
    fraction = changes.get("soft_alert_fraction")
    if fraction is not None and not math.isfinite(fraction):
        # NaN passes the model's 0-1 validators (every comparison with it is false)
        raise ValidationError({"soft_alert_fraction": "Enter a number from 0 to 1."})
    for name, value in changes.items():
        setattr(quota, name, value)
    quota.full_clean()
    quota.save(update_fields=list(changes))
    republish_tenant_keys(quota.tenant_id)
    return quota


@transaction.atomic
def do_set_key_override(override: KeyQuotaOverride, **changes: Any) -> KeyQuotaOverride:
    """Per-key limits; they only ever tighten the tenant's quota (the lower value wins)."""
    _check_fields(changes, OVERRIDE_FIELDS)
    for name, value in changes.items():
        setattr(override, name, value)
    # The model's own bounds (0 up to PostgreSQL's integer): beyond them a save is a 500.
    override.full_clean(exclude=["api_key"])
    override.save()
    republish_keys([override.api_key_id])
    return override


def _check_fields(changes: dict[str, Any], allowed: Collection[str]) -> None:
    unknown = set(changes).difference(allowed)
    if unknown:
        raise ValueError(f"Cannot change {', '.join(sorted(unknown))}.")


# ---------------------------------------------------------------- the gateway's view


def _lower(value: int, override: int | None) -> int:
    return value if override is None else min(value, override)


def build_principal(key: ApiKey) -> KeyPrincipal | None:
    """The gateway's view of a key, or None when it must be refused (revoked)."""
    if key.is_revoked:
        return None
    tenant = key.tenant
    quota = Quota.objects.filter(tenant=tenant).first() or Quota(tenant=tenant)
    override = KeyQuotaOverride.objects.filter(api_key=key).first()

    def merged(field: str) -> int:
        return _lower(getattr(quota, field), getattr(override, field, None))

    limits = EffectiveLimits(
        requests_per_minute=merged("requests_per_minute"),
        tokens_per_minute=merged("tokens_per_minute"),
        concurrent_streams=merged("concurrent_streams"),
        max_tokens_cap=merged("max_tokens_cap"),
        max_context_tokens=merged("max_context_tokens"),
        monthly_token_budget=quota.monthly_token_budget,
        monthly_spend_budget_usd=quota.monthly_spend_budget_usd,
        soft_alert_fraction=quota.soft_alert_fraction,
        hard_budget=quota.hard_budget,
        tenant_requests_per_minute=quota.requests_per_minute,
        tenant_tokens_per_minute=quota.tokens_per_minute,
        tenant_concurrent_streams=quota.concurrent_streams,
    )
    return KeyPrincipal(
        key_id=key.pk,
        key_prefix=key.prefix,
        tenant_id=tenant.pk,
        tenant_slug=tenant.slug,
        tenant_status=tenant.status,
        scopes=frozenset(key.scopes),
        model_allowlist=frozenset(key.model_allowlist),
        expires_at=key.expires_at.timestamp() if key.expires_at else None,
        fail_open=tenant.fail_open,
        allowed_regions=frozenset(tenant.allowed_regions),
        allowed_tiers=frozenset(quota.allowed_tiers),
        limits=limits,
        blocked_patterns=tuple(tenant.blocked_patterns),
    )


def api_key_for_raw_key(raw_key: str) -> ApiKey | None:
    """The key row a raw key names, compared in constant time; None when unknown."""
    prefix = key_prefix_of(raw_key)
    if prefix is None:
        return None
    key = ApiKey.objects.select_related("tenant").filter(prefix=prefix).first()
    if key is None or not hmac.compare_digest(key.secret_hash, hash_key(raw_key)):
        return None
    return key


def principal_for_raw_key(raw_key: str) -> KeyPrincipal | None:
    key = api_key_for_raw_key(raw_key)
    return build_principal(key) if key is not None else None


# ---------------------------------------------------------------- Redis records


def republish_keys(key_ids: Iterable[int]) -> None:
    ids = list(key_ids)
    transaction.on_commit(lambda: write_key_records(ApiKey.objects.filter(pk__in=ids)))


def republish_tenant_keys(tenant_id: int) -> None:
    transaction.on_commit(
        lambda: write_key_records(
            ApiKey.objects.filter(tenant_id=tenant_id), events=[f"tenant:{tenant_id}"]
        )
    )


def write_key_records(keys: Iterable[ApiKey], events: Sequence[str] | None = None) -> int:
    """Rewrite the Redis records of `keys` (tombstones for revoked ones) and tell every
    gateway process to drop them. Returns how many were written."""
    records = []
    for key in keys.select_related("tenant") if isinstance(keys, QuerySet) else keys:
        records.append((key.secret_hash, build_principal(key)))
    if events is None:
        events = [f"key:{secret_hash}" for secret_hash, _ in records]
    return _write_records(records, events)


def _write_records(records: list[tuple[str, KeyPrincipal | None]], events: Sequence[str]) -> int:
    try:
        client = redis_client()
        pipe = client.pipeline(transaction=False)
        for secret_hash, principal in records:
            pipe.set(key_record_name(secret_hash), encode_key_record(secret_hash, principal))
        pipe.execute()
        # After the records, and not pipelined: a Redis Cluster pipeline refuses PUBLISH.
        for event in events:
            client.publish(KEY_EVENTS_CHANNEL, event)
    except redis.RedisError as error:
        # Not retried here (Celery's broker is this same Redis). PostgreSQL has the change, and
        # it is not lost: each gateway rechecks keys in PostgreSQL once its key events are back
        # (tenants.keys, "A change the control plane could not write"), and the periodic
        # republish task rewrites every record once Redis is back.
        logger.error("Could not write %d API key records to Redis: %s", len(records), error)
        return 0
    return len(records)


def do_record_key_use() -> int:
    """Move the last-used times the gateways batched in Redis to PostgreSQL."""
    pipe = redis_client().pipeline(transaction=True)
    pipe.hgetall(LAST_USED_HASH)
    pipe.delete(LAST_USED_HASH)
    batch, _ = pipe.execute()
    updated = 0
    for raw_id, raw_time in batch.items():
        used_at = datetime.fromtimestamp(float(raw_time), tz=UTC)
        key_id = int(raw_id)
        updated += ApiKey.objects.filter(pk=key_id, last_used_at__lt=used_at).update(
            last_used_at=used_at
        )
        updated += ApiKey.objects.filter(pk=key_id, last_used_at__isnull=True).update(
            last_used_at=used_at
        )
    return updated


async def load_principal_from_database(raw_key: str) -> KeyPrincipal | None:
    """`principal_for_raw_key` off the event loop: the gateway's `KeyAuthenticator` loader
    (injected by `config.gateway`), asked only when Redis has no record of the key."""
    from asgiref.sync import sync_to_async

    return await sync_to_async(principal_for_raw_key)(raw_key)
