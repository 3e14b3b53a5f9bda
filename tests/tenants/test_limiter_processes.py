"""Four processes, each with its own asyncio Redis client, hammer the limits for ten seconds."""

from __future__ import annotations

import math
import multiprocessing
from typing import Any

import pytest
import redis
from django.conf import settings

from tenants.limiter import month_of, month_tokens_key
from tests.tenants.conftest import principal_with
from tests.tenants.workers import hammer

SECONDS = 10.0
PROCESSES = 4


@pytest.fixture(scope="module")
def hammered() -> dict[str, Any]:
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    # Tenant 1 is held by its requests per minute (small requests), tenant 2 by its tokens.
    by_requests = principal_with(tenant_id=1, requests_per_minute=1200, tokens_per_minute=10**8)
    by_tokens = principal_with(tenant_id=2, requests_per_minute=10**6, tokens_per_minute=120_000)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(
            target=hammer,
            args=(
                settings.REDIS_URL,
                [by_requests.to_dict(), by_tokens.to_dict()],
                SECONDS,
                n,
                results,
            ),
        )
        for n in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    reports = [results.get(timeout=SECONDS + 60) for _ in processes]
    for process in processes:
        process.join(timeout=10)
    month = month_of(reports[0]["started"])
    counters = {
        slug: int(client.get(month_tokens_key(tenant_id, month)) or 0)
        for slug, tenant_id in (("tenant-1", 1), ("tenant-2", 2))
    }
    leases = sum(client.zcard(key) for key in client.scan_iter("rl:*:streams"))
    client.flushdb()
    window = max(r["finished"] for r in reports) - min(r["started"] for r in reports)
    totals = {
        slug: {
            field: sum(r["stats"][slug][field] for r in reports)
            for field in ("admitted", "refused", "used_tokens")
        }
        for slug in ("tenant-1", "tenant-2")
    }
    return {"window": window, "totals": totals, "counters": counters, "leases": leases}


def allowance(per_minute: int, window_s: float) -> float:
    """At most the limit in any 60 s, from idle too: one limit per started minute."""
    return per_minute * math.ceil(window_s / 60)


def test_four_processes_admit_no_more_requests_than_the_limit_allows(
    hammered: dict[str, Any],
) -> None:
    admitted = hammered["totals"]["tenant-1"]["admitted"]
    limit = allowance(1200, hammered["window"])
    print(f"requests admitted {admitted} of {limit:.0f} allowed in {hammered['window']:.2f} s")
    assert hammered["totals"]["tenant-1"]["refused"] > 0
    assert admitted <= limit * 1.01
    assert admitted >= limit * 0.95  # the limit, not the clients, is what held them back


def test_four_processes_use_no_more_tokens_than_the_limit_allows(
    hammered: dict[str, Any],
) -> None:
    used = hammered["totals"]["tenant-2"]["used_tokens"]
    limit = allowance(120_000, hammered["window"])
    print(f"tokens used {used} of {limit:.0f} allowed in {hammered['window']:.2f} s")
    assert hammered["totals"]["tenant-2"]["refused"] > 0
    assert used <= limit * 1.01
    assert used >= limit * 0.9


def test_refunds_leave_exactly_the_tokens_used_on_the_monthly_counter(
    hammered: dict[str, Any],
) -> None:
    for slug in ("tenant-1", "tenant-2"):
        assert hammered["counters"][slug] == hammered["totals"][slug]["used_tokens"]


def test_every_stream_lease_is_released(hammered: dict[str, Any]) -> None:
    assert hammered["leases"] == 0
