"""Consumers that died stay out of the usage group: removed once idle, never with entries."""

from __future__ import annotations

import time
from typing import Any

import redis

from metering import ingest
from metering.usage import USAGE_STREAM, add_usage_event
from tenants.models import Tenant
from tests.metering.helpers import event
from tests.metering.test_ingest import acme  # noqa: F401 (fixture)

DEAD_AFTER_MS = 300


def consumers(client: redis.Redis) -> dict[str, int]:
    """Each consumer of the group with its pending entries."""
    return {
        c["name"].decode(): c["pending"] for c in client.xinfo_consumers(USAGE_STREAM, ingest.GROUP)
    }


def write_events(client: redis.Redis, tenant: Tenant, n: int) -> None:
    pipe = client.pipeline(transaction=False)
    for _ in range(n):
        add_usage_event(pipe, event(tenant.pk))
    pipe.execute()


def live(client: redis.Redis, min_idle_ms: int = ingest.MIN_IDLE_MS) -> ingest.Consumer:
    return ingest.Consumer(client, "alive", dead_after_ms=DEAD_AFTER_MS, min_idle_ms=min_idle_ms)


def test_a_dead_consumer_with_nothing_pending_leaves_the_group_once_idle(
    acme: Tenant,  # noqa: F811
    redis_client: redis.Redis,
) -> None:
    write_events(redis_client, acme, 1)
    ingest.ensure_group(redis_client)
    # It read an entry and acknowledged it, then its process died.
    read: Any = redis_client.xreadgroup(ingest.GROUP, "dead", {USAGE_STREAM: ">"})
    [[_, [(entry_id, _)]]] = read
    redis_client.xack(USAGE_STREAM, ingest.GROUP, entry_id)
    assert live(redis_client).remove_dead_consumers() == []  # not idle long enough yet
    assert consumers(redis_client) == {"dead": 0}
    time.sleep(DEAD_AFTER_MS / 1000 + 0.1)
    live(redis_client).drain(max_seconds=5)
    assert consumers(redis_client) == {"alive": 0}


def test_a_dead_consumer_keeps_its_pending_entries_until_they_are_claimed(
    acme: Tenant,  # noqa: F811
    redis_client: redis.Redis,
) -> None:
    write_events(redis_client, acme, 20)
    ingest.ensure_group(redis_client)
    redis_client.xreadgroup(ingest.GROUP, "dead", {USAGE_STREAM: ">"}, count=20)
    time.sleep(DEAD_AFTER_MS / 1000 + 0.1)
    # Its entries are not idle long enough to claim yet: it stays, holding them.
    live(redis_client, min_idle_ms=60_000).drain(max_seconds=5)
    assert consumers(redis_client)["dead"] == 20
    # Claimed and billed, then the dead consumer is gone in the same step.
    result = live(redis_client, min_idle_ms=0).drain(max_seconds=5)
    assert result.inserted == 20
    assert consumers(redis_client) == {"alive": 0}
    assert redis_client.xpending(USAGE_STREAM, ingest.GROUP)["pending"] == 0


def test_the_consumer_draining_is_never_removed_however_long_it_was_idle(
    acme: Tenant,  # noqa: F811
    redis_client: redis.Redis,
) -> None:
    consumer = live(redis_client)
    consumer.drain(max_seconds=5)
    time.sleep(DEAD_AFTER_MS / 1000 + 0.1)
    assert consumer.remove_dead_consumers() == []
    assert consumers(redis_client) == {"alive": 0}
