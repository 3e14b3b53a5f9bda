"""The per-replica circuit breaker, driven by an injected clock."""

from __future__ import annotations

import math

from serving.router import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock) -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=3, base_open_s=1.0, max_open_s=8.0, clock=clock)


def fail(b: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        b.record_failure()


def test_it_stays_closed_below_the_failure_threshold() -> None:
    b = breaker(Clock())
    fail(b, 2)
    assert b.state is BreakerState.CLOSED and b.allow_request()


def test_a_success_resets_the_consecutive_failure_count() -> None:
    b = breaker(Clock())
    fail(b, 2)
    b.record_success()
    fail(b, 2)
    assert b.state is BreakerState.CLOSED


def test_it_opens_after_consecutive_failures_and_refuses_requests() -> None:
    clock = Clock()
    b = breaker(clock)
    fail(b, 3)
    assert b.state is BreakerState.OPEN
    assert not b.allow_request()
    assert b.blocked_until == clock.now + 1.0


def test_after_the_open_time_it_lets_exactly_one_probe_through() -> None:
    clock = Clock()
    b = breaker(clock)
    fail(b, 3)
    clock.now += 1.0
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow_request()
    assert not b.allow_request()
    assert b.blocked_until == math.inf


def test_a_successful_probe_closes_it() -> None:
    clock = Clock()
    b = breaker(clock)
    fail(b, 3)
    clock.now += 1.0
    b.allow_request()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.blocked_until == 0.0


def test_a_failed_probe_reopens_it_for_twice_as_long() -> None:
    clock = Clock()
    b = breaker(clock)
    fail(b, 3)
    clock.now += 1.0
    b.allow_request()
    b.record_failure()
    assert b.state is BreakerState.OPEN
    assert b.blocked_until == clock.now + 2.0


def test_the_open_time_grows_exponentially_up_to_the_cap() -> None:
    clock = Clock()
    b = breaker(clock)
    fail(b, 3)
    open_times = []
    for _ in range(6):
        open_times.append(b.blocked_until - clock.now)
        clock.now = b.blocked_until
        b.allow_request()
        b.record_failure()
    assert open_times == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_after_closing_the_next_trip_starts_from_the_base_time_again() -> None:
    clock = Clock()
    b = breaker(clock)
    fail(b, 3)
    clock.now += 1.0
    b.allow_request()
    b.record_failure()
    clock.now += 2.0
    b.allow_request()
    b.record_success()
    fail(b, 3)
    assert b.blocked_until == clock.now + 1.0
