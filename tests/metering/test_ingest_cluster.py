"""The usage stream on Redis Cluster: written by the gateway's pipeline, drained into
PostgreSQL exactly once by the ingest consumer, whose Lua calls touch the stream's one slot."""

from __future__ import annotations

import pytest
from redis.cluster import RedisCluster

from config.redis import redis_client
from metering import ingest
from metering.usage import USAGE_STREAM
from tenants.models import Tenant
from tests.metering.helpers import event
from tests.metering.test_ingest import expected, totals, write
from tests.redis_cluster import LocalRedisCluster

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


def test_on_a_cluster_the_stream_is_drained_once_and_a_dead_consumers_entries_are_taken_over(
    redis_cluster: LocalRedisCluster,
) -> None:
    acme = Tenant.objects.create(slug="acme", name="Acme")
    client = redis_client(worker=True)
    assert isinstance(client, RedisCluster)
    events = [event(acme.pk) for _ in range(300)]
    write(client, events)
    # A consumer reads a batch and dies before acknowledging it.
    ingest.ensure_group(client)
    client.xreadgroup(ingest.GROUP, "dead", {USAGE_STREAM: ">"}, count=50)
    result = ingest.Consumer(client, "c1", batch_size=100, min_idle_ms=0, dead_after_ms=0).drain(
        max_seconds=10
    )
    assert (result.inserted, totals()) == (300, expected(events))
    assert client.xpending(USAGE_STREAM, ingest.GROUP)["pending"] == 0
    # The dead consumer, its entries taken over, is gone from the group (the Lua clean-up).
    consumers = {
        str(c["name"], "utf-8") for c in client.xinfo_consumers(USAGE_STREAM, ingest.GROUP)
    }
    assert "c1" in consumers
    assert "dead" not in consumers
    # The same events again (a replay) insert nothing.
    write(client, events)
    again = ingest.Consumer(client, "c2", batch_size=100).drain(max_seconds=10)
    assert (again.inserted, totals()) == (0, expected(events))
