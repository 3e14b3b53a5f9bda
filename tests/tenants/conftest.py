"""Fixtures of the tenants tests: the acme and globex tenants with a member of each role."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from typing import Any

import pytest
import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connections

from tenants.actions import do_create_tenant
from tenants.keys import EffectiveLimits, KeyPrincipal
from tenants.models import Membership, Role, Tenant

ROLES = {"owner": Role.OWNER, "admin": Role.ADMIN, "dev": Role.DEVELOPER, "viewer": Role.VIEWER}


def make_tenant(slug: str) -> Tenant:
    tenant = do_create_tenant(slug, slug.title())
    for suffix, role in ROLES.items():
        # no password: tests log in with force_login, and hashing one costs a third of a second
        user = get_user_model().objects.create_user(f"{slug}-{suffix}")
        Membership.objects.create(user=user, tenant=tenant, role=role)
    return tenant


@pytest.fixture
def acme(db: None, redis_client: Any) -> Tenant:
    return make_tenant("acme")


@pytest.fixture
def globex(db: None, redis_client: Any) -> Tenant:
    return make_tenant("globex")


def user(username: str) -> Any:
    return get_user_model().objects.get(username=username)


@pytest.fixture
async def aredis(redis_client: Any) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
    yield client
    await client.aclose()
    # the ORM calls of async tests ran on asgiref's sync thread: close its connection too,
    # or the test database cannot be dropped at the end
    await sync_to_async(connections.close_all)()


def principal_with(tenant_id: int = 1, key_id: int = 1, **limits: Any) -> KeyPrincipal:
    """A principal built in memory: the limiter needs no database."""
    values: dict[str, Any] = {
        "requests_per_minute": 600,
        "tokens_per_minute": 100_000,
        "concurrent_streams": 10,
        "max_tokens_cap": 4096,
        "max_context_tokens": 32_768,
        "monthly_token_budget": None,
        "monthly_spend_budget_usd": None,
        "soft_alert_fraction": 0.8,
        "hard_budget": True,
    }
    fail_open = limits.pop("fail_open", False)
    values.update(limits)
    if isinstance(values["monthly_spend_budget_usd"], str):
        values["monthly_spend_budget_usd"] = Decimal(values["monthly_spend_budget_usd"])
    return KeyPrincipal(
        key_id=key_id,
        key_prefix=f"k{key_id}",
        tenant_id=tenant_id,
        tenant_slug=f"tenant-{tenant_id}",
        tenant_status="active",
        scopes=frozenset({"inference"}),
        model_allowlist=frozenset(),
        expires_at=None,
        fail_open=fail_open,
        allowed_regions=frozenset(),
        allowed_tiers=frozenset({"standard"}),
        limits=EffectiveLimits(**values),
    )


@pytest.fixture
def make_principal() -> Callable[..., KeyPrincipal]:
    return principal_with
