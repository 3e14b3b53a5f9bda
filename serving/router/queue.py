"""A bounded admission queue with tier priority and aging, for when nothing meets the SLO.

The gateway awaits `wait_for_slot(tier)`; whoever frees capacity (a request finishing, a
telemetry update showing room) calls `release()`, which wakes the waiters that should go
first. Priority ages linearly: a request's effective rank is its tier rank minus the
seconds it has waited divided by `aging_s`. Since every waiter ages at the same rate, the
order never changes while they wait, so the heap key is fixed at arrival:
`tier_rank * aging_s + enqueued_at`. A batch request that has waited `2 * aging_s` goes
before an interactive one that just arrived, so batch never starves.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable

from serving.router.contracts import TIER_RANK


def queue_key(tier: str, enqueued_at: float, aging_s: float) -> float:
    """A waiter's place in the queue: its tier's rank times the aging, plus when it came
    (an unknown tier ranks last)."""
    return TIER_RANK.get(tier, max(TIER_RANK.values())) * aging_s + enqueued_at


class QueueFull(Exception):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"admission queue full; retry after {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


class AdmissionQueue:
    def __init__(
        self,
        max_size: int,
        aging_s: float,
        clock: Callable[[], float] = time.monotonic,
        min_retry_after_s: float = 1.0,
        max_retry_after_s: float = 60.0,
    ) -> None:
        if max_size < 1 or aging_s <= 0:
            raise ValueError("AdmissionQueue needs max_size >= 1 and aging_s > 0")
        self.max_size = max_size
        self.aging_s = aging_s
        self._clock = clock
        self._min_retry_after_s = min_retry_after_s
        self._max_retry_after_s = max_retry_after_s
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._sequence = itertools.count()
        self._waiting = 0
        # Smoothed seconds between released slots: how fast the queue drains.
        self._drain_interval_s: float | None = None
        self._last_release_at: float | None = None

    def __len__(self) -> int:
        return self._waiting

    def retry_after_s(self) -> float:
        """Seconds until a request arriving now could expect a place, from the drain rate."""
        if self._drain_interval_s is None:
            return self._min_retry_after_s
        estimate = self._waiting * self._drain_interval_s
        return min(max(estimate, self._min_retry_after_s), self._max_retry_after_s)

    async def wait_for_slot(
        self, tier: str, timeout_s: float | None = None, enqueued_at: float | None = None
    ) -> float:
        """Wait until released; return the seconds waited since `enqueued_at` (now if None:
        a waiter given a slot it may not use yet comes back with its first time, and keeps
        its place).

        Raises QueueFull at once when the queue is full, TimeoutError after `timeout_s`.
        """
        if self._waiting >= self.max_size:
            raise QueueFull(self.retry_after_s())
        if enqueued_at is None:
            enqueued_at = self._clock()
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(
            self._heap, (queue_key(tier, enqueued_at, self.aging_s), next(self._sequence), slot)
        )
        self._waiting += 1
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(slot)
        except BaseException:
            if slot.done():
                # Released just as we gave up: hand the slot to the next in line.
                self.release()
            else:
                slot.cancel()
                self._waiting -= 1
            raise
        return self._clock() - enqueued_at

    def release(self, slots: int = 1) -> int:
        """Wake up to `slots` waiters, best first; return how many were woken."""
        woken = 0
        while woken < slots and self._heap:
            _, _, slot = heapq.heappop(self._heap)
            if slot.done():
                continue  # cancelled or timed out; already uncounted
            slot.set_result(None)
            self._waiting -= 1
            woken += 1
            self._observe_release()
        return woken

    def _observe_release(self) -> None:
        now = self._clock()
        if self._last_release_at is not None:
            interval = now - self._last_release_at
            previous = self._drain_interval_s
            self._drain_interval_s = (
                interval if previous is None else 0.8 * previous + 0.2 * interval
            )
        self._last_release_at = now
