"""API keys: the gateway's check, revocation across processes, and secrets kept secret."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db.backends.utils import CursorWrapper
from django.utils import timezone

from tenants.actions import (
    do_create_api_key,
    do_record_key_use,
    do_revoke_api_key,
    do_update_quota,
    load_principal_from_database,
)
from tenants.keys import (
    MISSING_KEY_TTL_S,
    KeyAuthenticator,
    KeyPrincipal,
    generate_raw_key,
    hash_key,
    key_record_name,
    principal_from_record,
)
from tenants.models import ApiKey, KeyQuotaOverride, Quota, Tenant
from tests.tenants.conftest import user
from tests.tenants.workers import watch_key

pytestmark = pytest.mark.django_db(transaction=True)


def create_key(tenant: Tenant, **kw: Any) -> tuple[ApiKey, str]:
    return do_create_api_key(tenant, "test key", user(f"{tenant.slug}-owner"), ["inference"], **kw)


async def database_is_down(raw_key: str) -> KeyPrincipal | None:
    raise AssertionError("the hot path asked PostgreSQL")


async def authenticated(authenticator: KeyAuthenticator, raw_key: str) -> KeyPrincipal:
    """The key's principal: the key must be admitted."""
    principal = await authenticator.authenticate(raw_key)
    assert principal is not None, "the key was refused"
    return principal


async def test_a_new_key_is_admitted_from_redis_without_asking_postgres(
    acme: Tenant, aredis: aioredis.Redis
) -> None:
    key, raw = await sync_to_async(create_key)(acme)
    authenticator = KeyAuthenticator(aredis, load_from_database=database_is_down)
    principal = await authenticator.authenticate(raw)
    assert principal is not None
    assert (principal.key_id, principal.tenant_slug) == (key.pk, "acme")


async def test_a_key_missing_from_redis_is_found_in_postgres_and_written_back(
    acme: Tenant, aredis: aioredis.Redis
) -> None:
    key, raw = await sync_to_async(create_key)(acme)
    await aredis.delete(key_record_name(hash_key(raw)))
    principal = await KeyAuthenticator(
        aredis, load_from_database=load_principal_from_database
    ).authenticate(raw)
    assert principal is not None and principal.key_id == key.pk
    assert await aredis.exists(key_record_name(hash_key(raw)))


async def test_it_refuses_an_unknown_key_and_a_malformed_one(
    acme: Tenant, aredis: aioredis.Redis
) -> None:
    _, raw = await sync_to_async(create_key)(acme)
    authenticator = KeyAuthenticator(aredis, load_from_database=load_principal_from_database)
    assert await authenticator.authenticate(raw[:-1] + ("0" if raw[-1] != "0" else "1")) is None
    assert await authenticator.authenticate("not-a-key") is None


async def test_it_refuses_an_expired_key_even_from_its_cache(
    acme: Tenant, aredis: aioredis.Redis
) -> None:
    soon = timezone.now() + timedelta(seconds=1)
    _, raw = await sync_to_async(create_key)(acme, expires_at=soon)
    authenticator = KeyAuthenticator(
        aredis, cache_ttl_s=60, load_from_database=load_principal_from_database
    )
    assert await authenticator.authenticate(raw) is not None
    await asyncio.sleep(1.1)
    assert await authenticator.authenticate(raw) is None


async def test_a_quota_change_reaches_a_running_authenticator(
    acme: Tenant, aredis: aioredis.Redis
) -> None:
    _, raw = await sync_to_async(create_key)(acme)
    authenticator = KeyAuthenticator(
        aredis, cache_ttl_s=60, load_from_database=load_principal_from_database
    )
    await authenticator.start()
    try:
        assert (await authenticated(authenticator, raw)).limits.requests_per_minute == 600
        quota = await Quota.objects.aget(tenant=acme)
        await sync_to_async(do_update_quota)(quota, requests_per_minute=7)
        await asyncio.sleep(0.3)
        assert (await authenticated(authenticator, raw)).limits.requests_per_minute == 7
    finally:
        await authenticator.close()


def test_a_key_override_only_tightens_the_tenants_quota(acme: Tenant) -> None:
    from tenants.actions import build_principal

    key, _ = create_key(acme)
    KeyQuotaOverride.objects.create(api_key=key, requests_per_minute=5, tokens_per_minute=10**9)
    principal = build_principal(key)
    assert principal is not None
    limits = principal.limits
    assert (limits.requests_per_minute, limits.tenant_requests_per_minute) == (5, 600)
    assert limits.tokens_per_minute == limits.tenant_tokens_per_minute == 200_000


async def test_last_use_reaches_postgres_off_the_hot_path(
    acme: Tenant, aredis: aioredis.Redis
) -> None:
    key, raw = await sync_to_async(create_key)(acme)
    authenticator = KeyAuthenticator(aredis, load_from_database=load_principal_from_database)
    principal = await authenticated(authenticator, raw)
    authenticator.touch(principal.key_id)
    assert (await ApiKey.objects.aget(pk=key.pk)).last_used_at is None
    await authenticator.flush_touches()
    assert await sync_to_async(do_record_key_use)() == 1
    assert (await ApiKey.objects.aget(pk=key.pk)).last_used_at is not None


def test_a_revoked_key_is_refused_by_every_running_process_within_a_second(
    acme: Tenant,
) -> None:
    key, raw = create_key(acme)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=watch_key, args=(settings.REDIS_URL, raw, results, 10.0))
        for _ in range(4)
    ]
    for process in processes:
        process.start()
    try:
        ready = [results.get(timeout=60) for _ in processes]
        assert [state for state, _ in ready] == ["ready"] * 4
        time.sleep(0.2)  # every process is in its authenticate loop, key cached
        revoked_at = time.time()
        do_revoke_api_key(key, user("acme-owner"))
        refusals = [results.get(timeout=15) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=15)
    delays = [at - revoked_at for _, at in refusals]
    print(f"revocation seen after {', '.join(f'{d * 1000:.0f} ms' for d in delays)}")
    assert [state for state, _ in refusals] == ["refused"] * 4
    assert max(delays) < 1.0


def test_the_secret_is_stored_only_as_its_hash(acme: Tenant, redis_client: Any) -> None:
    key, raw = create_key(acme)
    secret = raw.split("-", 2)[2]
    stored = ApiKey.objects.filter(pk=key.pk).values()[0]
    assert stored["secret_hash"] == hash_key(raw)
    assert not any(secret in str(value) for value in stored.values())
    for name in redis_client.scan_iter():
        assert secret.encode() not in name + (redis_client.get(name) or b"")


async def test_made_up_keys_do_not_grow_the_cache_past_its_bound(aredis: aioredis.Redis) -> None:
    async def unknown(raw_key: str) -> None:
        return None

    authenticator = KeyAuthenticator(aredis, cache_max_entries=50, load_from_database=unknown)
    for i in range(200):
        assert await authenticator.authenticate(f"sk-{i:08x}-{'f' * 48}") is None
    assert len(authenticator._cache) == 50


@pytest.fixture
def key_queries() -> Iterator[list[str]]:
    """The SQL statements that read API keys, from any thread, while the test runs."""
    seen: list[str] = []
    execute = CursorWrapper.execute

    def counting(self: CursorWrapper, sql: str, *args: Any, **kwargs: Any) -> Any:
        if "tenants_apikey" in sql:
            seen.append(sql)
        return execute(self, sql, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CursorWrapper, "execute", counting)
        yield seen


async def test_a_repeated_unknown_key_asks_postgres_once_across_processes(
    acme: Tenant, aredis: aioredis.Redis, key_queries: list[str]
) -> None:
    raw, _ = generate_raw_key()
    # three gateway processes, each past its own few seconds of in-process cache every time
    workers = [
        KeyAuthenticator(aredis, cache_ttl_s=0, load_from_database=load_principal_from_database)
        for _ in range(3)
    ]
    for _ in range(10):
        for worker in workers:
            assert await worker.authenticate(raw) is None
    assert len(key_queries) == 1
    assert 0 < await aredis.ttl(key_record_name(hash_key(raw))) <= MISSING_KEY_TTL_S


async def test_a_repeated_unknown_key_asks_postgres_once_while_redis_is_down(
    acme: Tenant, aredis: aioredis.Redis, key_queries: list[str]
) -> None:
    raw, _ = generate_raw_key()
    unreachable = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    authenticator = KeyAuthenticator(
        unreachable, timeout_s=0.5, load_from_database=load_principal_from_database
    )
    try:
        for _ in range(20):
            assert await authenticator.authenticate(raw) is None
    finally:
        await unreachable.aclose()
    assert len(key_queries) == 1


async def test_a_key_created_after_a_miss_works_at_once(
    acme: Tenant, aredis: aioredis.Redis
) -> None:
    raw, _ = generate_raw_key()
    running = KeyAuthenticator(
        aredis, cache_ttl_s=60, load_from_database=load_principal_from_database
    )
    await running.start()
    try:
        assert await running.authenticate(raw) is None  # remembered as unknown, here and in Redis
        key, _ = await sync_to_async(create_key)(acme, raw_key=raw)
        # another process, which never saw the key, finds it in Redis without PostgreSQL
        other = KeyAuthenticator(aredis, load_from_database=database_is_down)
        assert (await authenticated(other, raw)).key_id == key.pk
        # and the process that missed it drops its memory of the miss on the key's event
        deadline = time.monotonic() + 1.0
        while (principal := await running.authenticate(raw)) is None:
            assert time.monotonic() < deadline, "the miss outlived the key's creation"
            await asyncio.sleep(0.01)
        assert principal.key_id == key.pk
    finally:
        await running.close()


async def test_a_miss_overtaken_by_the_keys_creation_is_not_remembered(
    acme: Tenant, aredis: aioredis.Redis
) -> None:
    raw, _ = generate_raw_key()
    created: list[ApiKey] = []

    async def created_while_looking(raw_key: str) -> KeyPrincipal | None:
        # PostgreSQL answered before the key was committed; the key, its record and its
        # event all land before that answer reaches the authenticator.
        key, _ = await sync_to_async(create_key)(acme, raw_key=raw_key)
        created.append(key)
        authenticator.forget(f"key:{hash_key(raw_key)}")
        return None

    authenticator = KeyAuthenticator(
        aredis, cache_ttl_s=60, load_from_database=created_while_looking
    )
    assert await authenticator.authenticate(raw) is None
    assert (await authenticated(authenticator, raw)).key_id == created[0].pk
    assert len(created) == 1


@pytest.mark.parametrize(
    "raw_key",
    [
        "",
        "sk-",
        "sk-nope-nope",
        "sk-0123abcd-" + "f" * 47,
        "sk-0123abcd-" + "f" * 49,
        "sk-0123ABCD-" + "f" * 48,
        "sk-0123abcd-" + "f" * 48 + "\n",
        "pk-0123abcd-" + "f" * 48,
        "sk-0123abcd-" + "f" * 10_000,
    ],
)
async def test_a_string_not_shaped_like_a_key_is_refused_without_any_lookup(
    raw_key: str,
) -> None:
    unreachable = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    authenticator = KeyAuthenticator(unreachable, load_from_database=database_is_down)
    try:
        started = time.monotonic()
        assert await authenticator.authenticate(raw_key) is None
        assert time.monotonic() - started < 0.1  # no connection attempt, let alone a query
    finally:
        await unreachable.aclose()
    assert not authenticator._cache


async def test_a_subscribed_authenticator_takes_postgres_word_over_a_stale_redis_record(
    acme: Tenant, aredis: aioredis.Redis
) -> None:
    key, raw = await sync_to_async(create_key)(acme)
    # A revoke whose write to Redis was lost: PostgreSQL has it, Redis still admits the key.
    await sync_to_async(ApiKey.objects.filter(pk=key.pk).update)(revoked_at=timezone.now())
    authenticator = KeyAuthenticator(aredis, load_from_database=load_principal_from_database)
    await authenticator.start()
    try:
        assert await authenticator.authenticate(raw) is None
    finally:
        await authenticator.close()
    record = await aredis.get(key_record_name(hash_key(raw)))
    assert record is not None
    assert principal_from_record(record, hash_key(raw)) is None


async def test_a_recheck_postgres_cannot_answer_trusts_redis(
    acme: Tenant, aredis: aioredis.Redis
) -> None:
    _, raw = await sync_to_async(create_key)(acme)
    asked: list[str] = []

    async def unreachable(raw_key: str) -> KeyPrincipal | None:
        asked.append(raw_key)
        raise ConnectionError("PostgreSQL is down")

    authenticator = KeyAuthenticator(aredis, cache_ttl_s=0, load_from_database=unreachable)
    await authenticator.start()
    try:
        assert [await authenticator.authenticate(raw) is not None for _ in range(3)] == [True] * 3
    finally:
        await authenticator.close()
    assert len(asked) == 1  # then Redis is trusted, as before the recheck existed
