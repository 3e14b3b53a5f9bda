"""A per-minute limit means at most that much in any 60 seconds, from idle too: the limiter
counts a sliding 60 s window, never a full bucket plus its refill."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from tenants.limiter import RateLimiter
from tests.tenants.conftest import principal_with

TPM = 6000


class VirtualClock:
    """Seconds since the epoch, moved on by the test (the limiter reads it in place of TIME)."""

    def __init__(self) -> None:
        self.now = float(int(time.time()))

    def __call__(self) -> float:
        return self.now


def rid() -> str:
    return uuid.uuid4().hex


def most_in_any_window(admitted: list[tuple[float, int]], window_s: float = 60.0) -> int:
    """The largest total of admissions (time, amount) that fall in one window_s window."""
    admitted = sorted(admitted)
    most = 0
    for start, _ in admitted:
        most = max(most, sum(n for t, n in admitted if start <= t < start + window_s))
    return most


async def hammer_for(
    limiter: RateLimiter, principal: Any, seconds: float, *, clients: int = 4
) -> list[int]:
    """Admit requests of 100 tokens as fast as the limiter allows, for `seconds` of real time;
    each is settled as fully used. Returns the tokens of each admission."""
    deadline = time.monotonic() + seconds
    admitted: list[int] = []

    async def one_client() -> None:
        while time.monotonic() < deadline:
            admission = await limiter.admit(
                principal, request_id=rid(), prompt_tokens=40, max_tokens=60
            )
            if admission.allowed:
                assert admission.reservation is not None
                admitted.append(100)
                await limiter.settle(admission.reservation, prompt_tokens=40, completion_tokens=60)
            else:
                await asyncio.sleep(0.005)

    await asyncio.gather(*(one_client() for _ in range(clients)))
    return admitted


async def test_from_idle_the_first_seconds_admit_no_more_tokens_than_the_minute_allows(
    aredis: aioredis.Redis,
) -> None:
    # A bucket that starts full and refills as it goes admits TPM + TPM/60 * 3 s here.
    principal = principal_with(tokens_per_minute=TPM, requests_per_minute=10**6)
    admitted = await hammer_for(RateLimiter(aredis), principal, 3.0)
    assert sum(admitted) == TPM


async def test_from_idle_the_first_seconds_admit_no_more_requests_than_the_minute_allows(
    aredis: aioredis.Redis,
) -> None:
    principal = principal_with(requests_per_minute=60, tokens_per_minute=10**8)
    admitted = await hammer_for(RateLimiter(aredis), principal, 3.0)
    assert len(admitted) == 60


async def test_no_60_second_window_admits_more_than_the_tokens_per_minute(
    aredis: aioredis.Redis,
) -> None:
    clock = VirtualClock()
    limiter = RateLimiter(aredis, clock=clock)
    principal = principal_with(tokens_per_minute=TPM, requests_per_minute=10**6)
    rng = random.Random(7)
    # (when, tokens it holds in the window): what it used once settled, else its reservation
    taken: list[tuple[float, int]] = []
    started = clock.now
    # From idle, a tenant that always has a request waiting, for 200 s of virtual time.
    while clock.now < started + 200:
        prompt, max_tokens = rng.randint(20, 300), rng.randint(50, 400)
        admission = await limiter.admit(
            principal, request_id=rid(), prompt_tokens=prompt, max_tokens=max_tokens
        )
        if admission.allowed:
            assert admission.reservation is not None
            completion = rng.randint(0, max_tokens)
            if rng.random() < 0.8:
                await limiter.settle(
                    admission.reservation, prompt_tokens=prompt, completion_tokens=completion
                )
                taken.append((clock.now, prompt + completion))
            else:  # still running when the window moves on
                taken.append((clock.now, prompt + max_tokens))
        else:
            clock.now += rng.choice((0.05, 0.3, 1.7))

    assert sum(n for t, n in taken if t < started + 60) <= TPM  # the first minute from idle
    assert most_in_any_window(taken) <= TPM
    # The limit, not the client, is what held it back: about TPM a minute all along.
    assert sum(n for _, n in taken) >= 3 * TPM * 0.9


async def test_the_retry_after_is_when_the_window_has_room_again(aredis: aioredis.Redis) -> None:
    clock = VirtualClock()
    clock.now += 0.25
    limiter = RateLimiter(aredis, clock=clock)
    principal = principal_with(tokens_per_minute=1000, requests_per_minute=10**6)

    async def take(tokens: int) -> Any:
        return await limiter.admit(principal, request_id=rid(), prompt_tokens=0, max_tokens=tokens)

    assert (await take(600)).allowed
    clock.now += 10
    assert (await take(300)).allowed
    refused = await take(500)
    assert (refused.allowed, refused.limit) == (False, "tokens")
    # the 600 leave the window a minute after the whole second they were taken in
    assert refused.retry_after_s is not None
    assert 50 < refused.retry_after_s <= 51
    clock.now += refused.retry_after_s - 0.01
    assert not (await take(500)).allowed
    clock.now += 0.01
    assert (await take(500)).allowed


async def test_a_release_gives_the_window_back_what_the_admission_took(
    aredis: aioredis.Redis,
) -> None:
    limiter = RateLimiter(aredis)
    principal = principal_with(tokens_per_minute=1000, requests_per_minute=10**6)
    first = await limiter.admit(principal, request_id=rid(), prompt_tokens=100, max_tokens=800)
    assert first.reservation is not None
    await limiter.release(first.reservation)  # as when the admission's answer was lost
    second = await limiter.admit(principal, request_id=rid(), prompt_tokens=100, max_tokens=800)
    assert second.allowed
