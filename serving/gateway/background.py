"""The gateway's background tasks: stopping them, repeating a publish while Redis comes and
goes, and following a Redis pub/sub channel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the tasks and wait until each has ended, whatever it ended with."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


async def repeat(
    wait: Callable[[], Awaitable[object]],
    step: Callable[[], Awaitable[None]],
    what: str,
    *,
    on_error: Callable[[], None] | None = None,
    backoff_s: float = 0.0,
) -> None:
    """Forever: `wait`, then `step`. While Redis is away, log that `what` could not be done,
    call `on_error` and sleep `backoff_s` before waiting again."""
    while True:
        await wait()
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError, TimeoutError) as error:
            log.warning("could not %s: %s", what, error)
            if on_error is not None:
                on_error()
            if backoff_s:
                await asyncio.sleep(backoff_s)


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
