"""The admission queue: tier priority, aging, bounds and Retry-After."""

from __future__ import annotations

import asyncio

import pytest

from serving.router import AdmissionQueue, QueueFull


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def enqueue(queue: AdmissionQueue, tier: str, order: list[str], label: str) -> None:
    await queue.wait_for_slot(tier)
    order.append(label)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def drain(queue: AdmissionQueue, tasks: list[asyncio.Task[None]]) -> None:
    await settle()
    while len(queue):
        queue.release()
        await settle()
    await asyncio.gather(*tasks)


async def test_interactive_goes_before_standard_before_batch() -> None:
    queue = AdmissionQueue(max_size=10, aging_s=30.0, clock=Clock())
    order: list[str] = []
    tasks = [
        asyncio.create_task(enqueue(queue, tier, order, tier))
        for tier in ("batch", "standard", "interactive")
    ]
    await drain(queue, tasks)
    assert order == ["interactive", "standard", "batch"]


async def test_a_batch_request_that_waited_long_enough_goes_before_new_interactive_ones() -> None:
    clock = Clock()
    queue = AdmissionQueue(max_size=10, aging_s=30.0, clock=clock)
    order: list[str] = []
    tasks = [asyncio.create_task(enqueue(queue, "batch", order, "old batch"))]
    await settle()
    clock.now += 61.0  # more than two tiers' worth of aging
    tasks.append(asyncio.create_task(enqueue(queue, "interactive", order, "new interactive")))
    await drain(queue, tasks)
    assert order == ["old batch", "new interactive"]


async def test_a_batch_request_that_waited_a_little_still_yields_to_interactive() -> None:
    clock = Clock()
    queue = AdmissionQueue(max_size=10, aging_s=30.0, clock=clock)
    order: list[str] = []
    tasks = [asyncio.create_task(enqueue(queue, "batch", order, "batch"))]
    await settle()
    clock.now += 10.0
    tasks.append(asyncio.create_task(enqueue(queue, "interactive", order, "interactive")))
    await drain(queue, tasks)
    assert order == ["interactive", "batch"]


async def test_same_tier_requests_are_served_in_arrival_order() -> None:
    clock = Clock()
    queue = AdmissionQueue(max_size=10, aging_s=30.0, clock=clock)
    order: list[str] = []
    tasks = []
    for label in ("first", "second", "third"):
        tasks.append(asyncio.create_task(enqueue(queue, "standard", order, label)))
        await settle()
        clock.now += 0.1
    await drain(queue, tasks)
    assert order == ["first", "second", "third"]


async def test_a_full_queue_refuses_at_once_with_a_retry_after() -> None:
    queue = AdmissionQueue(max_size=1, aging_s=30.0, clock=Clock())
    waiter = asyncio.create_task(queue.wait_for_slot("standard"))
    await settle()
    with pytest.raises(QueueFull) as refused:
        await queue.wait_for_slot("interactive")
    assert refused.value.retry_after_s >= 1.0
    queue.release()
    await waiter


async def test_retry_after_grows_with_the_queue_and_the_drain_interval() -> None:
    clock = Clock()
    queue = AdmissionQueue(max_size=100, aging_s=30.0, clock=clock)
    tasks = [asyncio.create_task(queue.wait_for_slot("standard")) for _ in range(20)]
    await settle()
    for _ in range(5):
        clock.now += 2.0
        queue.release()
    await settle()
    # 15 waiting, one released every 2 s: about 30 s.
    assert queue.retry_after_s() == pytest.approx(30.0)
    queue.release(15)
    await asyncio.gather(*tasks)


async def test_a_waiter_that_times_out_leaves_the_queue() -> None:
    queue = AdmissionQueue(max_size=5, aging_s=30.0)
    with pytest.raises(TimeoutError):
        await queue.wait_for_slot("standard", timeout_s=0.01)
    assert len(queue) == 0


async def test_a_released_slot_skips_waiters_that_gave_up() -> None:
    queue = AdmissionQueue(max_size=5, aging_s=30.0, clock=Clock())
    quitter = asyncio.create_task(queue.wait_for_slot("interactive"))
    stayer = asyncio.create_task(queue.wait_for_slot("batch"))
    await settle()
    quitter.cancel()
    await settle()
    assert queue.release() == 1
    assert await stayer == 0.0
    assert len(queue) == 0


async def test_a_waiter_coming_back_with_its_first_time_keeps_its_place() -> None:
    # A deferred request given a slot it may not use yet comes back (`Gateway.wait_in_queue`)
    # with the time it first came: ahead of a standard request that came after it, and it
    # reports the whole wait.
    clock = Clock()
    queue = AdmissionQueue(max_size=10, aging_s=30.0, clock=clock)
    order: list[str] = []
    waited: list[float] = []

    async def come_back() -> None:
        waited.append(await queue.wait_for_slot("standard", enqueued_at=0.0))
        order.append("first")

    clock.now = 5.0
    tasks = [asyncio.create_task(enqueue(queue, "standard", order, "later"))]
    await settle()
    tasks.append(asyncio.create_task(come_back()))
    await drain(queue, tasks)
    assert order == ["first", "later"] and waited == [5.0]
