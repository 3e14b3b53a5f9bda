"""The limiter when Redis answers late or not at all: nothing an admission took stays held."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from tenants.limiter import (
    DEFERRED_MAX_AGE_S,
    LimiterUnavailable,
    RateLimiter,
    Reservation,
    month_of,
    month_tokens_key,
    request_state_key,
    tenant_tag,
)
from tests.gateway.redis_proxy import RedisProxy
from tests.tenants.conftest import principal_with

# One stream at a time: a leaked lease would refuse the tenant's next stream.
ONE_STREAM = {"concurrent_streams": 1, "tokens_per_minute": 1000}


@pytest.fixture
def proxy(redis_client: object) -> Iterator[RedisProxy]:
    running = RedisProxy(settings.REDIS_URL).start()
    yield running
    running.stop()


async def warmed_up(limiter: RateLimiter, client: aioredis.Redis) -> None:
    """Two connections open and the scripts loaded before answers slow down, so the
    admission and its release each go out at once on a ready connection."""
    await limiter.load_scripts()
    await asyncio.gather(client.ping(), client.ping())


async def held_tokens(client: aioredis.Redis, tenant_id: int = 1) -> int:
    return int(await client.get(month_tokens_key(tenant_id, month_of(time.time()))) or 0)


async def leases(client: aioredis.Redis, tenant_id: int = 1) -> int:
    return int(await client.zcard(f"{tenant_tag(tenant_id)}:streams"))


async def test_an_admission_whose_answer_timed_out_is_released_and_the_next_stream_admitted(
    aredis: aioredis.Redis, proxy: RedisProxy
) -> None:
    slow = aioredis.Redis.from_url(proxy.url, socket_timeout=5)
    limiter = RateLimiter(slow, timeout_s=0.2)
    await warmed_up(limiter, slow)
    principal = principal_with(**ONE_STREAM)
    proxy.delay_s = 0.6  # the script runs at once; its answer comes after the timeout
    with pytest.raises(LimiterUnavailable):
        await limiter.admit(
            principal, request_id=uuid.uuid4().hex, prompt_tokens=100, max_tokens=400
        )
    await limiter.close()  # the release went out at once (its own answer was late too)
    proxy.delay_s = 0.0
    await limiter.retry_deferred()  # and was applied: the retry finds it done
    assert limiter.deferred == 0
    assert await leases(aredis) == 0
    assert await held_tokens(aredis) == 0
    # Given back because the admission had run ('cancelled' would mean it never did).
    states = [await aredis.get(key) async for key in aredis.scan_iter("rl:*:req:*")]
    assert states == [b"settled"]

    following = await RateLimiter(aredis).admit(
        principal, request_id=uuid.uuid4().hex, prompt_tokens=100, max_tokens=400
    )
    assert following.allowed
    # The whole token bucket is back (1000, less what this request reserved).
    assert following.headers["x-ratelimit-remaining-tokens"] == "500"
    await slow.aclose()


async def test_a_caller_cancelled_while_admitting_leaves_nothing_held(
    aredis: aioredis.Redis, proxy: RedisProxy
) -> None:
    slow = aioredis.Redis.from_url(proxy.url, socket_timeout=5)
    limiter = RateLimiter(slow, timeout_s=3)
    await warmed_up(limiter, slow)
    principal = principal_with(**ONE_STREAM)
    proxy.delay_s = 0.5
    admitting = asyncio.create_task(
        limiter.admit(principal, request_id=uuid.uuid4().hex, prompt_tokens=10, max_tokens=90)
    )
    await asyncio.sleep(0.2)  # the script has run; its answer is on its way
    assert await leases(aredis) == 1
    admitting.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await admitting
    await limiter.close()
    assert await leases(aredis) == 0
    assert await held_tokens(aredis) == 0
    await slow.aclose()


async def test_a_release_that_arrives_before_its_admission_makes_it_take_nothing(
    aredis: aioredis.Redis,
) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(**ONE_STREAM)
    request_id = uuid.uuid4().hex
    tag = tenant_tag(principal.tenant_id)
    reservation = Reservation(
        request_id=request_id,
        tenant_id=principal.tenant_id,
        key_id=principal.key_id,
        month=month_of(time.time()),
        reserved_tokens=500,
        token_buckets=((f"{tag}:tpm", 1000),),
        lease_keys=(f"{tag}:streams",),
    )
    await limiter.release(reservation)
    late = await limiter.admit(principal, request_id=request_id, prompt_tokens=100, max_tokens=400)
    assert (late.allowed, late.error) == (False, "request_cancelled")
    assert await leases(aredis) == 0
    assert await held_tokens(aredis) == 0
    # The tombstone lives only as long as a late admission could: about the lease TTL.
    ttl = await aredis.ttl(request_state_key(principal.tenant_id, request_id))
    assert 0 < ttl <= limiter.lease_ttl_s + 60


async def test_an_admissions_state_outlives_any_retry_of_its_settle_or_release(
    aredis: aioredis.Redis,
) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(**ONE_STREAM)
    request_id = uuid.uuid4().hex
    admission = await limiter.admit(
        principal, request_id=request_id, prompt_tokens=100, max_tokens=400
    )
    assert admission.allowed and admission.reservation is not None
    # A release retried a day later (Redis away all that time) must still find 'held'.
    ttl = await aredis.ttl(request_state_key(principal.tenant_id, request_id))
    assert ttl > DEFERRED_MAX_AGE_S
    await aredis.delete(f"{tenant_tag(principal.tenant_id)}:streams")  # the lease expired
    await limiter.release(admission.reservation)
    assert await held_tokens(aredis) == 0


async def test_a_release_after_a_normal_settle_gives_nothing_back_twice(
    aredis: aioredis.Redis,
) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(**ONE_STREAM)
    admission = await limiter.admit(
        principal, request_id=uuid.uuid4().hex, prompt_tokens=100, max_tokens=400
    )
    assert admission.reservation is not None
    assert await limiter.settle(admission.reservation, prompt_tokens=100, completion_tokens=50)
    await limiter.release(admission.reservation)
    assert await held_tokens(aredis) == 150


async def test_a_settle_while_redis_is_away_is_applied_once_it_is_back(
    aredis: aioredis.Redis, proxy: RedisProxy
) -> None:
    flaky = aioredis.Redis.from_url(proxy.url, socket_timeout=1)
    limiter = RateLimiter(flaky, timeout_s=0.5)
    principal = principal_with(**ONE_STREAM)
    admission = await limiter.admit(
        principal, request_id=uuid.uuid4().hex, prompt_tokens=100, max_tokens=400
    )
    assert admission.reservation is not None
    proxy.go_down()
    settled = await limiter.settle(admission.reservation, prompt_tokens=100, completion_tokens=20)
    assert (settled, limiter.deferred) == (False, 1)
    assert await limiter.retry_deferred() == 0  # still away: kept
    assert (await leases(aredis), limiter.deferred) == (1, 1)

    proxy.come_back()
    assert await limiter.retry_deferred() == 1
    assert limiter.deferred == 0
    assert await leases(aredis) == 0
    assert await held_tokens(aredis) == 120  # reserved 500, used 120: 380 refunded
    await flaky.aclose()


async def test_a_settle_whose_answer_was_lost_is_retried_without_refunding_twice(
    aredis: aioredis.Redis, proxy: RedisProxy
) -> None:
    slow = aioredis.Redis.from_url(proxy.url, socket_timeout=5)
    limiter = RateLimiter(slow, timeout_s=0.2)
    await warmed_up(limiter, slow)
    principal = principal_with(**ONE_STREAM)
    admission = await limiter.admit(
        principal, request_id=uuid.uuid4().hex, prompt_tokens=100, max_tokens=400
    )
    assert admission.reservation is not None
    proxy.delay_s = 0.6  # the settle runs; its answer is late
    settled = await limiter.settle(admission.reservation, prompt_tokens=100, completion_tokens=20)
    assert (settled, limiter.deferred) == (False, 1)
    proxy.delay_s = 0.0
    await limiter.retry_deferred()
    assert limiter.deferred == 0
    assert await held_tokens(aredis) == 120
    await slow.aclose()


async def test_an_admission_run_twice_for_one_request_is_allowed_twice_and_takes_once(
    aredis: aioredis.Redis,
) -> None:
    # What a client's retry on a new connection does when the first answer was lost.
    limiter = RateLimiter(aredis)
    principal = principal_with(**ONE_STREAM)
    request_id = uuid.uuid4().hex
    first = await limiter.admit(principal, request_id=request_id, prompt_tokens=100, max_tokens=400)
    again = await limiter.admit(principal, request_id=request_id, prompt_tokens=100, max_tokens=400)
    assert (first.allowed, again.allowed) == (True, True)
    assert await leases(aredis) == 1
    assert await held_tokens(aredis) == 500
    # Another request is still refused: the one stream slot is held once, not freed.
    other = await limiter.admit(
        principal, request_id=uuid.uuid4().hex, prompt_tokens=1, max_tokens=1
    )
    assert (other.allowed, other.limit) == (False, "concurrent_streams")
    assert first.reservation is not None
    await limiter.settle(first.reservation, prompt_tokens=100, completion_tokens=20)
    assert await leases(aredis) == 0
    assert await held_tokens(aredis) == 120
