"""Demo tenants: acme and globex, a member of each role in each, generous quotas, one
inference key of acme's whose secret stays the same across runs (kept in var/demo.json), and
a write-scoped staff API token of the admin's for trying the REST API from a shell (kept the
same way, and made again once it expires or is revoked).

The quota is the demo's only when the seed creates the tenant: `make run` seeds on every
start, and must not undo a quota or budget an operator has changed since."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.utils import timezone

from tenants.actions import (
    do_create_api_key,
    do_create_tenant,
    do_update_quota,
    write_key_records,
)
from tenants.models import ApiKey, Membership, Quota, Role, Scope, Tenant
from tenants.staff_token_actions import (
    do_create_staff_token,
    staff_token_for_raw_token,
    staff_token_refusal,
)
from tenants.staff_tokens import StaffTokenScope

DEMO_TENANTS = {"acme": "Acme Corporation", "globex": "Globex Corporation"}
DEMO_KEY_NAME = "Demo inference key"
DEMO_STAFF_TOKEN_NAME = "Demo automation"
# Made again this long before it expires, so a printed token works for a while yet.
DEMO_STAFF_TOKEN_MIN_LEFT = timedelta(days=7)
DEMO_MEMBERS = {
    Role.OWNER: "owner",
    Role.ADMIN: "admin",
    Role.DEVELOPER: "dev",
    Role.VIEWER: "viewer",
}
DEMO_QUOTA: dict[str, Any] = {
    "requests_per_minute": 600,
    "tokens_per_minute": 500_000,
    "concurrent_streams": 32,
    "max_tokens_cap": 4096,
    "max_context_tokens": 32_768,
    "monthly_token_budget": 500_000_000,
    "hard_budget": True,
}


def seed(details: dict[str, Any]) -> None:
    details.setdefault("tenant_password", "tenant-demo-" + os.urandom(4).hex())
    for slug, name in DEMO_TENANTS.items():
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            tenant = do_create_tenant(slug, name)
            do_update_quota(tenant.quota, **DEMO_QUOTA)
        else:
            Quota.objects.get_or_create(tenant=tenant, defaults=DEMO_QUOTA)
        for role, suffix in DEMO_MEMBERS.items():
            seed_member(tenant, f"{slug}-{suffix}", role, details["tenant_password"])
    seed_demo_key(details)
    seed_staff_token(details)


def seed_member(tenant: Tenant, username: str, role: str, password: str) -> None:
    user, _ = get_user_model().objects.get_or_create(
        username=username, defaults={"email": f"{username}@example.com"}
    )
    if not user.check_password(password):
        user.set_password(password)
        user.save()
    Membership.objects.update_or_create(user=user, tenant=tenant, defaults={"role": role})


def seed_demo_key(details: dict[str, Any]) -> None:
    acme = Tenant.objects.get(slug="acme")
    owner = get_user_model().objects.get(username="acme-owner")
    raw_key = details.get("acme_api_key")
    key = None
    if raw_key:
        key = ApiKey.objects.filter(tenant=acme, prefix=raw_key.split("-")[1]).first()
    if key is None:
        _, raw_key = do_create_api_key(
            acme,
            DEMO_KEY_NAME,
            owner,
            [Scope.INFERENCE, Scope.READ_USAGE],
            raw_key=raw_key or None,
        )
    else:
        # the Redis of this run may be new: make sure the gateway finds the key there
        write_key_records([key])
    details["acme_api_key"] = raw_key
    details["extra"]["Demo API key (acme)"] = raw_key
    details["extra"]["Tenant logins"] = (
        f"acme-owner / acme-admin / acme-dev / acme-viewer (and globex-*), "
        f"password {details['tenant_password']}"
    )


def seed_staff_token(details: dict[str, Any]) -> None:
    """The admin's demo staff token (write scope, 90 days): the same secret while it works."""
    admin = get_user_model().objects.filter(username=details.get("admin_username", "admin")).first()
    if admin is None or not admin.is_staff:
        return
    now = timezone.now()
    raw_token = details.get("staff_token")
    token = staff_token_for_raw_token(raw_token) if raw_token else None
    if (
        token is None
        or token.user_id != admin.pk
        or staff_token_refusal(token, now) is not None
        or token.expires_at - now < DEMO_STAFF_TOKEN_MIN_LEFT
    ):
        _, raw_token = do_create_staff_token(
            admin, DEMO_STAFF_TOKEN_NAME, StaffTokenScope.WRITE, now + timedelta(days=90)
        )
    details["staff_token"] = raw_token
    details["extra"]["Staff API token"] = f"{raw_token} (write scope, for /api from a shell)"
