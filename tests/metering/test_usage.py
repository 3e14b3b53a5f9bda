"""The gateway side: one XADD per settle, and the spool when Redis refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from django.conf import settings

from metering.usage import UsageSpool, add_usage_event
from tests.metering.helpers import event, stream_events


async def test_a_settle_pipeline_carries_the_event_to_the_stream(redis_client: redis.Redis) -> None:
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    sent = event(7, completion_tokens=37, status="client_cancelled")
    async with client.pipeline(transaction=False) as pipe:
        add_usage_event(pipe, sent)
        await pipe.execute()
    await client.aclose()
    assert stream_events(redis_client) == [sent]


async def test_spooled_events_are_replayed_and_the_spool_emptied(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    spool = UsageSpool(tmp_path / "usage.spool")
    spooled = [event(7) for _ in range(1203)]
    for e in spooled:
        spool.append(e)
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    sent = await spool.replay(client)
    await client.aclose()
    ids = [e.request_id for e in stream_events(redis_client)]
    assert (sent, spool.pending()) == (1203, 0)
    assert ids == [e.request_id for e in spooled]


async def test_a_replay_cut_short_by_redis_keeps_what_was_not_sent(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path / "usage.spool")
    for _ in range(10):
        spool.append(event(7))
    dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    with pytest.raises(redis.ConnectionError):
        await spool.replay(dead)
    await dead.aclose()
    assert spool.pending() == 10


def test_a_torn_last_line_costs_no_event_appended_after_it(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path / "usage.spool")
    spool.append(event(7))
    with spool.path.open("ab") as f:
        f.write(b'{"request_id": "torn')  # the gateway died mid-write
    spool.append(event(7))
    assert spool.pending() == 2
