"""Idempotency-Key on non-streaming requests, in Redis.

The same key and body within 24 hours replays the first response; the same key with another
body is a 422; the same key while the first request still runs is a 409. Keys are scoped by
tenant so two tenants never share one. Within a tenant, a replay is served only to a key that
passes the checks a fresh request would (`Exchange.check`: model allowlist, tier, caps,
guardrails; the tenant's status and the key's scope before that), so one key never reads a
response another key of the tenant was allowed to ask for and it is not.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import orjson
import redis.asyncio as aioredis

from serving.gateway.errors import ApiError

REPLAY_TTL_S = 24 * 3600
# A request that crashed its gateway must not block its key for a day.
RUNNING_TTL_S = 600


@dataclass(slots=True)
class StoredResponse:
    status: int
    body: bytes


def _key(tenant_id: str, idempotency_key: str) -> str:
    digest = hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]
    return f"idem:{tenant_id}:{digest}"


def body_fingerprint(raw_body: bytes) -> str:
    return hashlib.sha256(raw_body).hexdigest()


async def claim(
    redis: aioredis.Redis | aioredis.RedisCluster,
    tenant_id: str,
    idempotency_key: str,
    fingerprint: str,
) -> StoredResponse | None:
    """Claim the key for this request, or return the stored response to replay.

    Raises 409 while another request with the key runs, 422 if the body differs.
    """
    if len(idempotency_key) > 255:
        raise ApiError(
            400, "Idempotency-Key is longer than 255 characters.", param="Idempotency-Key"
        )
    key = _key(tenant_id, idempotency_key)
    record = orjson.dumps({"state": "running", "fingerprint": fingerprint})
    if await redis.set(key, record, nx=True, ex=RUNNING_TTL_S):
        return None
    existing = await redis.get(key)
    if existing is None:  # expired between the two calls: claim again
        return await claim(redis, tenant_id, idempotency_key, fingerprint)
    stored = orjson.loads(existing)
    if stored["fingerprint"] != fingerprint:
        raise ApiError(
            422,
            "This Idempotency-Key was already used with a different request body.",
            code="idempotency_key_reused",
            param="Idempotency-Key",
        )
    if stored["state"] == "running":
        raise ApiError(
            409,
            "A request with this Idempotency-Key is still in progress; retry later.",
            code="idempotency_key_in_use",
            headers={"Retry-After": "1"},
        )
    return StoredResponse(status=int(stored["status"]), body=stored["body"].encode())


async def complete(
    redis: aioredis.Redis | aioredis.RedisCluster,
    tenant_id: str,
    idempotency_key: str,
    fingerprint: str,
    status: int,
    body: bytes,
) -> None:
    record = {"state": "done", "fingerprint": fingerprint, "status": status, "body": body.decode()}
    await redis.set(_key(tenant_id, idempotency_key), orjson.dumps(record), ex=REPLAY_TTL_S)


async def release(
    redis: aioredis.Redis | aioredis.RedisCluster, tenant_id: str, idempotency_key: str
) -> None:
    """Forget a claim whose request failed before producing a response worth replaying."""
    await redis.delete(_key(tenant_id, idempotency_key))
