"""The heartbeat's telemetry on Redis Cluster: written, read back for the console and
forgotten, over keys that lie in different slots (no multi-key command may span them)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from redis.cluster import RedisCluster

from config.redis import redis_client
from serving import telemetry
from serving.console import queries
from tests.redis_cluster import LocalRedisCluster

pytestmark = pytest.mark.slow

REPLICAS = [str(n) for n in range(1, 21)]


def test_on_a_cluster_telemetry_is_stored_read_for_the_console_and_forgotten(
    redis_cluster: LocalRedisCluster,
) -> None:
    client = redis_client()
    assert isinstance(client, RedisCluster)
    slots = {client.keyslot(telemetry.replica_key(rid)) for rid in REPLICAS}
    assert len(slots) > 1  # the reads below would be CROSSSLOT as one MGET
    rows = [
        (rid, {"num_requests_running": int(rid), "kv_cache_usage_perc": 0.5}) for rid in REPLICAS
    ]
    gpus = [{"index": 0, "utilization_pct": 40.0}]
    now = datetime.now(UTC)
    telemetry.store_latest(client, 1, gpus, rows[:10], now)
    telemetry.store_latest(client, 2, [{"index": 0, "utilization_pct": 80.0}], rows[10:], now)
    seen = queries._replica_telemetry(client, REPLICAS)
    assert {rid: row["num_requests_running"] for rid, row in seen.items()} == {
        rid: int(rid) for rid in REPLICAS
    }
    assert sorted(queries._node_utilizations(client, [1, 2, 3])) == [40.0, 80.0]
    telemetry.forget_replicas(client, REPLICAS[:15])
    assert set(queries._replica_telemetry(client, REPLICAS)) == set(REPLICAS[15:])
    assert set(telemetry.read_routing_telemetry(client)) == set(REPLICAS[15:])
