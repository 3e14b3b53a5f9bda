"""The gateway's background tasks: stopping them, and following a Redis pub/sub channel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

log = logging.getLogger(__name__)


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the tasks and wait until each has ended, whatever it ended with."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


async def follow_channel(
    redis: aioredis.Redis | aioredis.RedisCluster,
    channel: str,
    on_message: Callable[[bytes], Awaitable[None]],
    *,
    subscribed: asyncio.Event | None = None,
) -> None:
    """Call `on_message` with each message published on `channel`, forever: while Redis is
    away, log it and subscribe again a second later (`subscribed` is clear meanwhile)."""
    while True:
        pubsub = redis.pubsub()
        try:
            await pubsub.subscribe(channel)
            if subscribed is not None:
                subscribed.set()
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    await on_message(message["data"])
        except asyncio.CancelledError:
            raise
        except Exception as error:  # Redis away: keep serving from memory, retry
            log.warning("%s interrupted: %s", channel, error)
            if subscribed is not None:
                subscribed.clear()
            await asyncio.sleep(1.0)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]  # unannotated in redis-py
