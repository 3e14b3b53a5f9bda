"""The rate limiter, one limit at a time, against a real Redis."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from tenants.limiter import (
    LimiterUnavailable,
    RateLimiter,
    format_reset,
    month_spend_key,
    month_tokens_key,
)
from tests.tenants.conftest import principal_with


def rid() -> str:
    return uuid.uuid4().hex


async def admit(limiter: RateLimiter, principal: Any, **kw: Any) -> Any:
    kw.setdefault("prompt_tokens", 10)
    kw.setdefault("max_tokens", 10)
    return await limiter.admit(principal, request_id=rid(), **kw)


async def counter(aredis: aioredis.Redis, key: str) -> int:
    """A month counter the limiter keeps in Redis; it must exist."""
    value = await aredis.get(key)
    assert value is not None, f"no counter {key}"
    return int(value)


async def test_it_refuses_the_request_past_the_requests_per_minute(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(requests_per_minute=5)
    results = [await admit(limiter, principal) for _ in range(6)]
    assert [r.allowed for r in results] == [True] * 5 + [False]
    refused = results[-1]
    assert (refused.error, refused.limit) == ("rate_limit_exceeded", "requests")
    # room comes back when the second of the first five leaves the 60 s window
    assert 60 < refused.retry_after_s <= 61
    assert refused.headers["retry-after"] == "61"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


async def test_it_refuses_a_reservation_past_the_tokens_per_minute(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(tokens_per_minute=1000)
    first = await admit(limiter, principal, prompt_tokens=300, max_tokens=400)
    second = await admit(limiter, principal, prompt_tokens=100, max_tokens=300)
    assert first.allowed
    assert (second.allowed, second.limit) == (False, "tokens")
    assert second.headers["x-ratelimit-remaining-tokens"] == "300"


async def test_it_refuses_a_request_larger_than_the_whole_token_limit(
    aredis: aioredis.Redis,
) -> None:
    admission = await admit(
        RateLimiter(aredis), principal_with(tokens_per_minute=100), max_tokens=200
    )
    assert (admission.allowed, admission.limit) == (False, "tokens_request_too_large")


async def test_it_takes_nothing_when_one_limit_refuses(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(requests_per_minute=100, tokens_per_minute=1000)
    await admit(limiter, principal, prompt_tokens=500, max_tokens=400)
    refused = await admit(limiter, principal, prompt_tokens=500, max_tokens=400)
    after = await admit(limiter, principal, prompt_tokens=1, max_tokens=1)
    assert not refused.allowed
    # the refused request took no request slot: 100 - 2 admitted
    assert after.headers["x-ratelimit-remaining-requests"] == "98"


async def test_it_refunds_unused_tokens_at_settle(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(tokens_per_minute=1000)
    first = await admit(limiter, principal, prompt_tokens=100, max_tokens=800)
    await limiter.settle(first.reservation, prompt_tokens=100, completion_tokens=50)
    second = await admit(limiter, principal, prompt_tokens=100, max_tokens=700)
    assert second.allowed
    month = first.reservation.month
    assert await counter(aredis, month_tokens_key(principal.tenant_id, month)) == 150 + 800


async def test_a_second_settle_of_the_same_reservation_changes_nothing(
    aredis: aioredis.Redis,
) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with()
    admission = await admit(limiter, principal, prompt_tokens=100, max_tokens=100)
    applied = [
        await limiter.settle(
            admission.reservation, prompt_tokens=100, completion_tokens=10, charged_usd_micros=7
        )
        for _ in range(2)
    ]
    month = admission.reservation.month
    assert applied == [True, False]
    assert await counter(aredis, month_tokens_key(principal.tenant_id, month)) == 110
    assert await counter(aredis, month_spend_key(principal.tenant_id, month)) == 7


async def test_settle_commands_run_in_the_callers_pipeline(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis)
    await limiter.load_scripts()  # the settle EVALSHA in a pipeline relies on it
    principal = principal_with()
    admission = await admit(limiter, principal, prompt_tokens=40, max_tokens=60)
    pipe = aredis.pipeline(transaction=False)
    await limiter.settle_commands(
        pipe, admission.reservation, prompt_tokens=40, completion_tokens=5, charged_usd_micros=3
    )
    pipe.xadd("usage-test", {"request_id": admission.reservation.request_id})
    results = await pipe.execute()
    assert results[0] == 1
    assert await aredis.xlen("usage-test") == 1
    assert await aredis.zcard(admission.reservation.lease_keys[0]) == 0
    month = admission.reservation.month
    assert await counter(aredis, month_tokens_key(principal.tenant_id, month)) == 45


async def test_it_refuses_a_request_past_the_concurrent_limit(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(concurrent_streams=2)
    held = [await admit(limiter, principal) for _ in range(2)]
    refused = await admit(limiter, principal)
    assert all(a.allowed for a in held)
    assert (refused.allowed, refused.limit) == (False, "concurrent_streams")
    await limiter.settle(held[0].reservation, prompt_tokens=10, completion_tokens=1)
    assert (await admit(limiter, principal)).allowed


async def test_every_admission_holds_a_concurrency_lease_until_it_settles(
    aredis: aioredis.Redis,
) -> None:
    # concurrent_streams counts every request in flight: a non-streamed request holds a
    # replica's sequence slot for as long as a stream of the same length.
    limiter = RateLimiter(aredis)
    principal = principal_with(concurrent_streams=1)
    admission = await admit(limiter, principal)
    assert admission.reservation.lease_keys
    assert await aredis.zcard(admission.reservation.lease_keys[0]) == 1
    await limiter.settle(admission.reservation, prompt_tokens=10, completion_tokens=1)
    assert await aredis.zcard(admission.reservation.lease_keys[0]) == 0


async def test_a_crashed_holders_lease_expires_and_leaks_no_slot(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis, lease_ttl_s=1)
    principal = principal_with(concurrent_streams=1)
    crashed = await admit(limiter, principal)  # never settled
    assert crashed.allowed
    assert not (await admit(limiter, principal)).allowed
    await asyncio.sleep(1.1)
    assert (await admit(limiter, principal)).allowed


async def test_a_renewed_lease_outlives_its_first_expiry(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis, lease_ttl_s=1)
    principal = principal_with(concurrent_streams=1)
    long_stream = await admit(limiter, principal)
    await asyncio.sleep(0.6)
    await limiter.renew_lease(long_stream.reservation)
    await asyncio.sleep(0.6)
    assert not (await admit(limiter, principal)).allowed


async def test_a_key_override_limits_the_key_below_its_tenant(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis)
    tight = principal_with(key_id=1, requests_per_minute=2, tenant_requests_per_minute=100)
    other = principal_with(key_id=2, requests_per_minute=100, tenant_requests_per_minute=100)
    tight_results = [(await admit(limiter, tight)).allowed for _ in range(3)]
    assert tight_results == [True, True, False]
    other_admission = await admit(limiter, other)
    assert other_admission.allowed
    # two of the tight key, this one; the refused third took nothing
    assert other_admission.headers["x-ratelimit-remaining-requests"] == "97"


async def test_it_refuses_with_insufficient_quota_when_the_token_budget_would_be_passed(
    aredis: aioredis.Redis,
) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(monthly_token_budget=1000)
    first = await admit(limiter, principal, prompt_tokens=400, max_tokens=400)
    second = await admit(limiter, principal, prompt_tokens=100, max_tokens=200)
    assert first.allowed and first.budget_alert
    assert (second.allowed, second.error, second.limit) == (
        False,
        "insufficient_quota",
        "monthly_token_budget",
    )


async def test_it_refuses_once_the_spend_budget_is_spent(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(monthly_spend_budget_usd="0.50")
    admission = await admit(limiter, principal)
    await limiter.settle(
        admission.reservation, prompt_tokens=10, completion_tokens=10, charged_usd_micros=500_000
    )
    refused = await admit(limiter, principal)
    assert (refused.error, refused.limit) == ("insufficient_quota", "monthly_spend_budget")


async def test_a_soft_budget_alerts_but_admits(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(monthly_token_budget=100, hard_budget=False)
    admissions = [
        await admit(limiter, principal, prompt_tokens=50, max_tokens=50) for _ in range(2)
    ]
    assert all(a.allowed for a in admissions)
    assert admissions[-1].budget_alert


async def test_it_reports_the_openai_rate_limit_headers(aredis: aioredis.Redis) -> None:
    limiter = RateLimiter(aredis)
    admission = await admit(
        limiter,
        principal_with(requests_per_minute=60, tokens_per_minute=6000),
        prompt_tokens=100,
        max_tokens=500,
    )
    # reset: when this second has left the window and it is empty again
    reset = admission.headers["x-ratelimit-reset-tokens"]
    assert reset in ("1m0s", "1m1s")
    assert admission.headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": reset,
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5400",
        "x-ratelimit-reset-tokens": reset,
    }


def test_reset_durations_read_like_openais() -> None:
    assert [format_reset(s) for s in (0.02, 1.0, 6.5, 360.0)] == ["20ms", "1s", "7s", "6m0s"]


def failures(mode: str) -> float:
    return REGISTRY.get_sample_value("platform_limiter_redis_failures_total", {"mode": mode}) or 0.0


async def unreachable_redis() -> aioredis.Redis:
    # nothing listens on port 1: every call fails at once
    return aioredis.Redis(host="127.0.0.1", port=1, socket_timeout=0.2, socket_connect_timeout=0.2)


async def test_it_fails_closed_when_redis_is_unreachable(caplog: pytest.LogCaptureFixture) -> None:
    limiter = RateLimiter(await unreachable_redis(), timeout_s=0.5)
    before = failures("closed")
    with pytest.raises(LimiterUnavailable, match="rate limiter is unavailable"):
        await admit(limiter, principal_with(fail_open=False))
    assert failures("closed") == before + 1
    assert "fails closed" in caplog.text


async def test_it_fails_open_for_a_tenant_that_chose_to(caplog: pytest.LogCaptureFixture) -> None:
    limiter = RateLimiter(await unreachable_redis(), timeout_s=0.5)
    before = failures("open")
    admission = await admit(limiter, principal_with(fail_open=True))
    assert admission.allowed and admission.degraded
    assert failures("open") == before + 1
    assert "fails open" in caplog.text
    assert not await limiter.settle(admission.reservation, prompt_tokens=1, completion_tokens=1)
