"""A per-replica circuit breaker: stop sending to a replica that keeps failing.

Closed: requests flow and consecutive failures are counted. After `failure_threshold` of
them it opens for `base_open_s`, doubling on each trip that follows without a success in
between, up to `max_open_s`. When the open time is over it is half-open: exactly one probe
request is let through; its success closes the breaker and forgets the trips, its failure
opens it again for the next, longer, time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        base_open_s: float = 1.0,
        max_open_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or base_open_s <= 0 or max_open_s < base_open_s:
            raise ValueError(
                "CircuitBreaker needs threshold >= 1 and 0 < base_open_s <= max_open_s"
            )
        self.failure_threshold = failure_threshold
        self.base_open_s = base_open_s
        self.max_open_s = max_open_s
        self._clock = clock
        self._failures = 0
        self._trips = 0
        self._open_until = 0.0
        self._probe_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._trips == 0:
            return BreakerState.CLOSED
        if self._clock() < self._open_until:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    @property
    def blocked_until(self) -> float:
        """What to put in `ReplicaState.breaker_open_until` so the router agrees with us.

        While the half-open probe is out, nothing else may go: infinity until it reports.
        """
        if self._probe_in_flight:
            return math.inf
        return self._open_until if self._trips else 0.0

    def allow_request(self) -> bool:
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN or self._probe_in_flight:
            return False
        self._probe_in_flight = True
        return True

    def abandon_probe(self) -> None:
        """The half-open probe ended without a verdict (its client left, or the request was
        refused as invalid): let the next request probe instead."""
        self._probe_in_flight = False

    def record_success(self) -> None:
        self._failures = 0
        self._trips = 0
        self._open_until = 0.0
        self._probe_in_flight = False

    def record_failure(self) -> None:
        if self._trips:
            # A failed probe (or a straggler that was already in flight) re-opens at once.
            self._trip()
            return
        self._failures += 1
        if self._failures >= self.failure_threshold:
            self._trip()

    def _trip(self) -> None:
        self._trips += 1
        self._failures = 0
        self._probe_in_flight = False
        open_s = min(self.base_open_s * 2.0 ** (self._trips - 1), self.max_open_s)
        self._open_until = self._clock() + open_s
