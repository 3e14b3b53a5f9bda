"""Latest telemetry in Redis, sampled history in PostgreSQL.

Keys (all JSON, all expiring so a silent node's numbers vanish instead of going stale):
- `telemetry:replica:<id>`: everything the agent last scraped from one replica.
- `telemetry:node:<id>`: the node's GPUs as the agent last saw them.
- `routing:telemetry`: hash replica id -> compact JSON (running, waiting, kv, loras,
  scraped_at), read in one HGETALL by every gateway process.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

import orjson
import redis

from serving.redis_contracts import ROUTING_TELEMETRY_KEY

LATEST_TTL_S = 30
SAMPLE_EVERY_S = 30


def replica_key(replica_id: str) -> str:
    return f"telemetry:replica:{replica_id}"


def node_key(node_id: int) -> str:
    return f"telemetry:node:{node_id}"


def compact(telemetry: dict[str, Any]) -> dict[str, Any]:
    """The few numbers the router scores replicas by."""
    return {
        "running": int(telemetry.get("num_requests_running") or 0),
        "waiting": int(telemetry.get("num_requests_waiting") or 0),
        "kv": float(telemetry.get("kv_cache_usage_perc") or 0.0),
        # Adapters resident on the replica (the agent's list), not just those running now:
        # the router prefers replicas where an adapter needs no load.
        "loras": list(
            telemetry.get("loaded_lora_adapters") or telemetry.get("running_lora_adapters") or []
        ),
        "scraped_at": telemetry.get("scraped_at"),
    }


def store_latest(
    client: redis.Redis,
    node_id: int,
    gpus: list[dict[str, Any]],
    replicas: Iterable[tuple[str, dict[str, Any]]],
    received_at: datetime,
) -> None:
    """Write one heartbeat's telemetry in a single round trip."""
    stamp = received_at.isoformat()
    pipe = client.pipeline(transaction=False)
    pipe.set(
        node_key(node_id),
        orjson.dumps({"node_id": node_id, "gpus": gpus, "received_at": stamp}),
        ex=LATEST_TTL_S,
    )
    compact_rows: dict[str, bytes] = {}
    for replica_id, telemetry in replicas:
        full = {**telemetry, "replica_id": replica_id, "node_id": node_id, "received_at": stamp}
        pipe.set(replica_key(replica_id), orjson.dumps(full), ex=LATEST_TTL_S)
        compact_rows[replica_id] = orjson.dumps(compact(telemetry))
    if compact_rows:
        pipe.hset(ROUTING_TELEMETRY_KEY, mapping=compact_rows)  # type: ignore[arg-type]
    pipe.execute()


def claim_sample_slots(client: redis.Redis, replica_ids: list[str]) -> list[str]:
    """The replicas due for a history sample: at most one per replica per SAMPLE_EVERY_S,
    however many heartbeats, control-plane processes or replays arrive."""
    if not replica_ids:
        return []
    pipe = client.pipeline(transaction=False)
    for replica_id in replica_ids:
        pipe.set(f"telemetry:sampled:{replica_id}", 1, nx=True, ex=SAMPLE_EVERY_S)
    claimed = pipe.execute()
    return [rid for rid, won in zip(replica_ids, claimed, strict=True) if won]


def read_replica(client: redis.Redis, replica_id: str) -> dict[str, Any] | None:
    raw = client.get(replica_key(replica_id))
    return None if raw is None else orjson.loads(raw)


def read_routing_telemetry(client: redis.Redis) -> dict[str, dict[str, Any]]:
    """Every replica's compact telemetry, in one call (what the gateway refreshes from)."""
    rows = client.hgetall(ROUTING_TELEMETRY_KEY)
    return {key.decode(): orjson.loads(value) for key, value in rows.items()}  # type: ignore[union-attr]


def forget_replicas(client: redis.Redis, replica_ids: Iterable[str]) -> None:
    ids = list(replica_ids)
    if not ids:
        return
    pipe = client.pipeline(transaction=False)
    pipe.hdel(ROUTING_TELEMETRY_KEY, *ids)
    for rid in ids:  # one key a DEL: keys in different slots are CROSSSLOT on a Cluster
        pipe.delete(replica_key(rid))
    pipe.execute()
