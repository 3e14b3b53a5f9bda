"""The gateways' prefix indexes kept in step through Redis pub/sub.

Each gateway's router remembers where it sent each prompt prefix (`PrefixIndex`); with N
gateways each knew only its own sends, so a shared document was prefilled on up to N
replicas and the share of prompt tokens the router could expect cached halved (rag on 6
H100 with 16 gateways: 0.51 -> 0.26, bench/RESULTS.md). Each gateway now publishes what it
records, in batches every `flush_s`, and records what the others publish into its own
index, as if it had sent those requests itself.

A message is `{"g": gateway id, "r": [[tenant, [block hash, ...], replica id], ...]}`; a
gateway skips its own. Best effort: a batch lost while Redis is away costs cache affinity,
never a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import orjson
import redis.asyncio as aioredis

from serving.gateway.background import cancel_all, follow_channel, repeat
from serving.router import PrefixIndex

log = logging.getLogger(__name__)

PREFIX_CHANNEL = "routing:prefixes"
FLUSH_S = 0.02  # a batch at most this old: well under a request's own first token
MAX_BATCH = 512  # records a message carries at most


class PrefixSync:
    def __init__(
        self,
        redis: aioredis.Redis | aioredis.RedisCluster,
        gateway_id: str,
        index: Callable[[], PrefixIndex],
        *,
        channel: str = PREFIX_CHANNEL,
        flush_s: float = FLUSH_S,
    ) -> None:
        self.redis = redis
        self.gateway_id = gateway_id
        self.index = index  # the current routing snapshot's index (carried across versions)
        self.channel = channel
        self.flush_s = flush_s
        self._pending: list[tuple[str, Sequence[int], str]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.subscribed = asyncio.Event()

    def recorded(self, tenant: str, hashes: Sequence[int], replica_id: str) -> None:
        """This gateway recorded a prompt's prefix against a replica: tell the others."""
        if hashes and len(self._pending) < 8 * MAX_BATCH:  # Redis away: drop, not grow
            self._pending.append((tenant, hashes, replica_id))

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._publish_forever(), name="prefix-publish"),
            asyncio.create_task(self._follow_forever(), name="prefix-follow"),
        ]

    async def close(self) -> None:
        await cancel_all(self._tasks)

    async def flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            message = orjson.dumps(
                {"g": self.gateway_id, "r": [[t, list(h), r] for t, h, r in batch]}
            )
            await self.redis.publish(self.channel, message)

    def apply(self, raw: bytes | str) -> int:
        """Record another gateway's batch into this one's index; how many records."""
        message = orjson.loads(raw)
        if not isinstance(message, dict):
            raise ValueError("a prefix record batch is a JSON object")
        if message.get("g") == self.gateway_id:
            return 0
        index = self.index()
        records = message.get("r") or []
        for tenant, hashes, replica_id in records:
            index.record(tenant, hashes, replica_id)
        return len(records)

    async def _publish_forever(self) -> None:
        await repeat(
            lambda: asyncio.sleep(self.flush_s),
            self.flush,
            "publish prefix records",
            on_error=self._drop_pending,
        )

    def _drop_pending(self) -> None:
        self._pending = []  # Redis away: a lost record costs affinity, never a request

    async def _follow_forever(self) -> None:
        await follow_channel(self.redis, self.channel, self._on_batch, subscribed=self.subscribed)

    async def _on_batch(self, raw: bytes) -> None:
        try:
            self.apply(raw)
        except (ValueError, TypeError) as error:
            log.warning("a malformed prefix record batch: %s", error)
