"""The rate limiter: every limit of a request checked and taken in ONE Redis Lua call.

`RateLimiter.admit` runs `lua/admit.lua`: requests-per-minute and tokens-per-minute as sliding
windows, a lease on a concurrent-request slot, and the monthly token and spend budgets. All
pass and all are taken, or nothing is taken.

A per-minute limit holds over any 60 seconds, from idle too: a window counts what was taken
in the current whole second of Redis `TIME` and the 60 before it, and admits a request only
if its cost fits under the limit. Any 60 s span touches at most 61 whole seconds, so it never
holds more than the limit (a token bucket that starts full and refills as it goes would admit
twice the limit in the first minute). The price of counting whole seconds: a client that
spreads its load evenly gets the limit per 61 s, and a refusal waits until the second that
makes room has left the window. Each admission drops the seconds that left the window from a
running total, so it is O(1) amortized (at most 61 steps after an idle spell).

Tokens are reserved up front (prompt estimate + max_tokens, as OpenAI does); `settle` refunds
or charges the difference once the response is done (in the second the reservation was
counted in, while the window still holds it), releases the lease and adds the spend, exactly
once per reservation. A charge past the reservation after its second has left the window is
not counted against it.

Redis keys, all of one tenant under the hash tag `{t:<tenant_id>}`:

    rl:{t:<tenant>}:rpm:w                hash s (total in the window), o (oldest second
                                         counted), n (newest), <epoch second> (taken in that
                                         second): the tenant's request window
    rl:{t:<tenant>}:tpm:w                the tenant's token window
    rl:{t:<tenant>}:k:<key>:rpm:w / :tpm:w  a key's own windows (only when its override is
                                         lower); named apart from the token buckets of before,
                                         so the two never share a key during a rollout
    rl:{t:<tenant>}:streams              zset request id -> lease expiry (epoch seconds), one
                                         per request in flight, streamed or not
    rl:{t:<tenant>}:k:<key>:streams      the key's own lease set (only when lower)
    rl:{t:<tenant>}:month:<YYYY-MM>:tokens        tokens used this month (UTC), reserved included
    rl:{t:<tenant>}:month:<YYYY-MM>:spend_micros  spend this month in micro-USD, added by settle
    rl:{t:<tenant>}:req:<request id>              the reservation's state: held:<second>
                                                  (admitted; its tokens were counted in that
                                                  second), settled, or cancelled (released
                                                  before it ran)

Leases: every admission holds one, streamed or not, from admission to settle. The quota field
is called `concurrent_streams` (and the lease sets `:streams`) from when only streams held one;
it bounds every request in flight, since a non-streamed request holds a replica's sequence
slot just as long as a stream of the same length does. A lease expires after `lease_ttl_s`
(10 min) unless `renew_lease` pushes it on, so a gateway that crashes mid-request leaks no
slot.

An admission whose answer never came back (the call timed out, or its caller was cancelled)
may still have run in Redis. `admit` then sends a release for its request id at once: the
settle script in 'release' mode gives back everything the admission took if it ran, and if it
has not run yet leaves a tombstone that makes it take nothing when it does; either order ends
with nothing held.

Settles and releases that cannot reach Redis are kept in memory and retried
(`retry_deferred`, which the gateway calls every few seconds), in order, until applied; the
state key makes a retry of one that did run harmless. What can still be lost: the deferred
calls of a gateway process that dies while Redis is away, and the oldest ones past
`DEFERRED_MAX` or older than `DEFERRED_MAX_AGE_S`. For those, the stream leases expire within
`lease_ttl_s`, the reserved tokens leave the window within a minute, the spend counter is
raised to what PostgreSQL billed by the budget task (metering.budgets), and only the month's
token counter stays too high by the unused part of those reservations.

One round trip at the end of a request: the gateway builds a pipeline, appends the settle
with `await limiter.settle_commands(pipe, reservation, ...)`, appends its own XADD of the
usage event, and executes the pipeline once.

Redis unreachable (or slower than the timeout): `admit` raises `LimiterUnavailable` (the
gateway answers 503 with its message) unless the principal's tenant fails open, in which
case it admits without limits (`Admission.degraded`). Both are logged and counted in
`platform_limiter_redis_failures_total{mode="closed"|"open"}`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tenants.keys import DEFAULT_TIMEOUT_S, KeyPrincipal
from tenants.redis_calls import bounded, is_cluster

logger = logging.getLogger(__name__)
T = TypeVar("T")

LUA_DIR = Path(__file__).resolve().parent / "lua"
ADMIT_SCRIPT = (LUA_DIR / "admit.lua").read_text()
SETTLE_SCRIPT = (LUA_DIR / "settle.lua").read_text()

DEFAULT_LEASE_TTL_S = 600
SETTLED_MARKER_TTL_S = 2 * 86400
# Deferred settles kept for a retry: at most this many (the oldest go first) ...
DEFERRED_MAX = 10_000
# ... and none older than this, well inside the settled marker's life, so that a retry of a
# settle that did run (only its answer was lost) still finds the marker and does nothing.
DEFERRED_MAX_AGE_S = 86400.0
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)

LIMITER_REDIS_FAILURES = Counter(
    "platform_limiter_redis_failures_total",
    "Admissions decided without Redis because it was unreachable, by fail mode.",
    ["mode"],
)
LIMITER_DEFERRED = Gauge(
    "platform_limiter_deferred_settles",
    "Settles and releases waiting for Redis to come back, in this process.",
)
LIMITER_DEFERRED_DROPPED = Counter(
    "platform_limiter_deferred_settles_dropped_total",
    "Deferred settles and releases given up (too many waiting, or too old).",
)


class LimiterUnavailable(Exception):
    """Redis cannot be reached and the tenant fails closed: answer 503."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            "The rate limiter is unavailable, so the request was not admitted; retry shortly. "
            f"({detail})"
        )


@dataclass(frozen=True)
class Reservation:
    """What an admission took, so `settle` can give back the right amount. Plain data."""

    request_id: str
    tenant_id: int
    key_id: int
    month: str
    reserved_tokens: int
    token_buckets: tuple[tuple[str, int], ...]  # (Redis key, per-minute limit)
    lease_keys: tuple[str, ...]
    degraded: bool = False  # admitted without Redis: nothing to settle

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "key_id": self.key_id,
            "month": self.month,
            "reserved_tokens": self.reserved_tokens,
            "token_buckets": [list(bucket) for bucket in self.token_buckets],
            "lease_keys": list(self.lease_keys),
            "degraded": self.degraded,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Reservation:
        return cls(
            request_id=str(data["request_id"]),
            tenant_id=int(data["tenant_id"]),
            key_id=int(data["key_id"]),
            month=str(data["month"]),
            reserved_tokens=int(data["reserved_tokens"]),
            token_buckets=tuple((str(k), int(c)) for k, c in data["token_buckets"]),
            lease_keys=tuple(data["lease_keys"]),
            degraded=bool(data.get("degraded", False)),
        )


@dataclass(frozen=True)
class Admission:
    allowed: bool
    error: str | None  # "rate_limit_exceeded" | "insufficient_quota" | None
    limit: str | None  # requests | tokens | tokens_request_too_large | concurrent_streams |
    #                    monthly_token_budget | monthly_spend_budget
    retry_after_s: float | None
    headers: dict[str, str] = field(default_factory=dict)
    reservation: Reservation | None = None
    degraded: bool = False
    month_tokens_used: int = 0
    month_spend_micros: int = 0
    budget_alert: bool = False  # past the soft alert fraction of a monthly budget


def tenant_tag(tenant_id: int) -> str:
    return f"rl:{{t:{tenant_id}}}"


def request_state_key(tenant_id: int, request_id: str) -> str:
    return f"{tenant_tag(tenant_id)}:req:{request_id}"


def month_of(epoch_s: float) -> str:
    return time.strftime("%Y-%m", time.gmtime(epoch_s))


def month_tokens_key(tenant_id: int, month: str) -> str:
    return f"{tenant_tag(tenant_id)}:month:{month}:tokens"


def month_spend_key(tenant_id: int, month: str) -> str:
    return f"{tenant_tag(tenant_id)}:month:{month}:spend_micros"


def format_reset(seconds: float) -> str:
    """OpenAI's duration style for x-ratelimit-reset-*: 20ms, 1s, 6m0s."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def usd_to_micros(usd: Any) -> int:
    return int((Decimal(str(usd)) * 1_000_000).to_integral_value())


class RateLimiter:
    def __init__(
        self,
        redis: aioredis.Redis | aioredis.RedisCluster,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        lease_ttl_s: int = DEFAULT_LEASE_TTL_S,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """`clock` (epoch seconds) replaces Redis `TIME` in admissions, for tests that move
        time on; every process must share one clock, so production leaves it None."""
        self._redis = redis
        self._clock = clock
        self._timeout_s = timeout_s
        # On a Redis Cluster a command is never cancelled mid-flight (tenants/redis_calls.py).
        self._shield = is_cluster(redis)
        self._lease_ttl_s = lease_ttl_s
        self._admit = redis.register_script(ADMIT_SCRIPT)
        self._settle = redis.register_script(SETTLE_SCRIPT)
        # request id -> (settle script keys, args, monotonic time first deferred)
        self._deferred: OrderedDict[str, tuple[list[str], list[Any], float]] = OrderedDict()
        self._retry_lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()

    async def admit(
        self,
        principal: KeyPrincipal,
        *,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
    ) -> Admission:
        limits = principal.limits
        tag = tenant_tag(principal.tenant_id)
        key_tag = f"{tag}:k:{principal.key_id}"
        reserve = max(0, prompt_tokens) + max(0, max_tokens)
        now = None if self._clock is None else self._clock()
        month = month_of(time.time() if now is None else now)

        buckets: list[tuple[str, int, int, str]] = []  # key, limit, cost, kind
        tenant_rpm = limits.tenant_requests_per_minute or limits.requests_per_minute
        tenant_tpm = limits.tenant_tokens_per_minute or limits.tokens_per_minute
        buckets.append((f"{tag}:rpm:w", tenant_rpm, 1, "r"))
        buckets.append((f"{tag}:tpm:w", tenant_tpm, reserve, "t"))
        # A key's own window only matters when it is tighter than the tenant's.
        if limits.requests_per_minute < tenant_rpm:
            buckets.append((f"{key_tag}:rpm:w", limits.requests_per_minute, 1, "r"))
        if limits.tokens_per_minute < tenant_tpm:
            buckets.append((f"{key_tag}:tpm:w", limits.tokens_per_minute, reserve, "t"))

        # Every request in flight holds a slot, streamed or not (see the module docstring).
        tenant_streams = limits.tenant_concurrent_streams or limits.concurrent_streams
        leases = [(f"{tag}:streams", tenant_streams)]
        if limits.concurrent_streams < tenant_streams:
            leases.append((f"{key_tag}:streams", limits.concurrent_streams))

        token_budget = -1 if limits.monthly_token_budget is None else limits.monthly_token_budget
        spend_budget = (
            -1
            if limits.monthly_spend_budget_usd is None
            else usd_to_micros(limits.monthly_spend_budget_usd)
        )
        keys = [
            month_tokens_key(principal.tenant_id, month),
            month_spend_key(principal.tenant_id, month),
            request_state_key(principal.tenant_id, request_id),
        ]
        keys += [bucket[0] for bucket in buckets] + [lease[0] for lease in leases]
        args: list[Any] = [
            len(buckets),
            len(leases),
            request_id,
            self._lease_ttl_s,
            reserve,
            token_budget,
            spend_budget,
            1 if limits.hard_budget else 0,
            SETTLED_MARKER_TTL_S,
            "" if now is None else repr(now),
        ]
        for _, capacity, cost, kind in buckets:
            args += [max(1, capacity), cost, kind]
        args += [max(1, limit) for _, limit in leases]

        reservation = Reservation(
            request_id=request_id,
            tenant_id=principal.tenant_id,
            key_id=principal.key_id,
            month=month,
            reserved_tokens=reserve,
            token_buckets=tuple((b[0], max(1, b[1])) for b in buckets if b[3] == "t"),
            lease_keys=tuple(lease[0] for lease in leases),
        )
        try:
            raw = await self._bounded(self._admit(keys=keys, args=args))
        except UNREACHABLE as error:
            # The script may have run with only its answer lost: give back what it took.
            self._release_soon(reservation)
            return self._without_redis(principal, request_id, month, error)
        except asyncio.CancelledError:
            self._release_soon(reservation)
            raise
        return _admission_from_script(
            raw, reservation, limits.soft_alert_fraction, token_budget, spend_budget
        )

    async def _bounded(self, command: Awaitable[T]) -> T:
        return await bounded(command, self._timeout_s, shield=self._shield)

    def _without_redis(
        self, principal: KeyPrincipal, request_id: str, month: str, error: BaseException
    ) -> Admission:
        mode = "open" if principal.fail_open else "closed"
        LIMITER_REDIS_FAILURES.labels(mode=mode).inc()
        logger.error(
            "Rate limiter Redis unreachable (%s: %s); tenant %s fails %s",
            type(error).__name__,
            error,
            principal.tenant_slug,
            mode,
        )
        if not principal.fail_open:
            raise LimiterUnavailable(f"{type(error).__name__}") from error
        reservation = Reservation(
            request_id=request_id,
            tenant_id=principal.tenant_id,
            key_id=principal.key_id,
            month=month,
            reserved_tokens=0,
            token_buckets=(),
            lease_keys=(),
            degraded=True,
        )
        return Admission(True, None, None, None, {}, reservation, degraded=True)

    async def settle_commands(
        self,
        pipeline: aioredis.client.Pipeline,
        reservation: Reservation,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        charged_usd_micros: int = 0,
    ) -> None:
        """Append this reservation's settle to `pipeline` (the caller executes it, with its
        own commands such as the usage event's XADD, in one round trip)."""
        keys, args = self._settle_call(
            reservation, prompt_tokens, completion_tokens, charged_usd_micros
        )
        # EVALSHA straight into the caller's pipeline: redis-py's Script object would add a
        # SCRIPT EXISTS round trip before every pipeline. `load_scripts()` (at start, and after
        # a NOSCRIPT from a restarted Redis) makes sure the script is there.
        pipeline.evalsha(self._settle.sha, len(keys), *keys, *args)

    async def load_scripts(self) -> None:
        """Load the Lua scripts into Redis (idempotent): `settle_commands` relies on it."""
        await self._bounded(self._redis.script_load(SETTLE_SCRIPT))
        await self._bounded(self._redis.script_load(ADMIT_SCRIPT))

    async def settle(
        self,
        reservation: Reservation,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        charged_usd_micros: int = 0,
    ) -> bool:
        """Settle once; True when applied, False when already settled or nothing to settle."""
        if reservation.degraded:
            return False
        keys, args = self._settle_call(
            reservation, prompt_tokens, completion_tokens, charged_usd_micros
        )
        applied = await self._send_or_defer(
            "settle", reservation.request_id, keys, args, logging.ERROR
        )
        return bool(applied)

    def defer_settle(
        self,
        reservation: Reservation,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        charged_usd_micros: int = 0,
    ) -> None:
        """Keep a settle that could not reach Redis for `retry_deferred` to send later."""
        if reservation.degraded:
            return
        keys, args = self._settle_call(
            reservation, prompt_tokens, completion_tokens, charged_usd_micros
        )
        self._defer(reservation.request_id, keys, args)

    def _release_soon(self, reservation: Reservation) -> None:
        task = asyncio.get_running_loop().create_task(self.release(reservation))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def release(self, reservation: Reservation) -> None:
        """Give back all an admission took, if it ran; if it has not run yet, make it take
        nothing when it does. For an admission whose answer was lost; idempotent."""
        keys, args = self._settle_call(reservation, 0, 0, 0, release=True)
        await self._send_or_defer("release", reservation.request_id, keys, args, logging.WARNING)

    async def _send_or_defer(
        self, what: str, request_id: str, keys: list[str], args: list[Any], level: int
    ) -> Any:
        """Run the settle script now; if Redis is unreachable, keep the call for
        `retry_deferred` and answer None."""
        try:
            return await self._bounded(self._settle(keys=keys, args=args))
        except UNREACHABLE as error:
            logger.log(
                level,
                "Could not %s %s: Redis unreachable (%s); retrying later",
                what,
                request_id,
                error,
            )
            self._defer(request_id, keys, args)
            return None

    def _defer(self, request_id: str, keys: list[str], args: list[Any]) -> None:
        self._deferred[request_id] = (keys, args, time.monotonic())
        while len(self._deferred) > DEFERRED_MAX:
            dropped, _ = self._deferred.popitem(last=False)
            LIMITER_DEFERRED_DROPPED.inc()
            logger.error("Gave up the settle of %s: too many waiting for Redis", dropped)
        LIMITER_DEFERRED.set(len(self._deferred))

    @property
    def deferred(self) -> int:
        """How many settles and releases wait for Redis in this process."""
        return len(self._deferred)

    async def retry_deferred(self) -> int:
        """Send the deferred settles and releases, oldest first, until one fails; return
        how many were sent. Each is idempotent, so one that had run already changes nothing."""
        sent = 0
        async with self._retry_lock:
            too_old = time.monotonic() - DEFERRED_MAX_AGE_S
            while self._deferred:
                request_id, (keys, args, since) = next(iter(self._deferred.items()))
                if since < too_old:
                    LIMITER_DEFERRED_DROPPED.inc()
                    logger.error("Gave up the settle of %s: Redis away too long", request_id)
                else:
                    try:
                        await self._bounded(self._settle(keys=keys, args=args))
                    except UNREACHABLE:
                        break
                    except RedisError as error:
                        # Refused, not unreachable: retrying would only block the rest.
                        LIMITER_DEFERRED_DROPPED.inc()
                        logger.error("Gave up the settle of %s: %s", request_id, error)
                    else:
                        sent += 1
                self._deferred.pop(request_id, None)
            LIMITER_DEFERRED.set(len(self._deferred))
        return sent

    async def close(self) -> None:
        """Wait briefly for releases in flight (each is bounded by the Redis timeout)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=self._timeout_s * 2)

    def _settle_call(
        self,
        reservation: Reservation,
        prompt_tokens: int,
        completion_tokens: int,
        charged_usd_micros: int,
        *,
        release: bool = False,
    ) -> tuple[list[str], list[Any]]:
        used = max(0, prompt_tokens) + max(0, completion_tokens)
        keys = [
            request_state_key(reservation.tenant_id, reservation.request_id),
            month_tokens_key(reservation.tenant_id, reservation.month),
            month_spend_key(reservation.tenant_id, reservation.month),
            *(key for key, _ in reservation.token_buckets),
            *reservation.lease_keys,
        ]
        args: list[Any] = [
            len(reservation.token_buckets),
            len(reservation.lease_keys),
            reservation.request_id,
            reservation.reserved_tokens - used,
            max(0, int(charged_usd_micros)),
            # A release that finds nothing leaves a tombstone only as long as the admission
            # it cancels could still be on its way (its state would have lived as long).
            self._lease_ttl_s + 60 if release else SETTLED_MARKER_TTL_S,
            "release" if release else "settle",
        ]
        return keys, args

    @property
    def lease_ttl_s(self) -> float:
        return float(self._lease_ttl_s)

    async def renew_lease(self, reservation: Reservation) -> None:
        """Push a long stream's lease expiry on (call it every few minutes while streaming)."""
        if not reservation.lease_keys:
            return
        seconds, micros = await self._bounded(self._redis.time())
        expiry = seconds + micros / 1_000_000 + self._lease_ttl_s
        pipe = self._redis.pipeline(transaction=False)
        for key in reservation.lease_keys:
            pipe.zadd(key, {reservation.request_id: expiry}, xx=True)
            # The set itself must outlive the renewed lease, as admission makes it do.
            pipe.expire(key, self._lease_ttl_s + 60)
        await self._bounded(pipe.execute())


def _admission_from_script(
    raw: list[Any],
    reservation: Reservation,
    soft_alert_fraction: float,
    token_budget: int,
    spend_budget: int,
) -> Admission:
    values = [v.decode() if isinstance(v, bytes) else str(v) for v in raw]
    allowed = values[0] == "1"
    retry_after = float(values[3]) if values[3] else None
    headers: dict[str, str] = {}
    for kind, (limit, remaining, reset) in (
        ("requests", values[4:7]),
        ("tokens", values[7:10]),
    ):
        if limit:
            headers[f"x-ratelimit-limit-{kind}"] = limit
            headers[f"x-ratelimit-remaining-{kind}"] = remaining
            headers[f"x-ratelimit-reset-{kind}"] = format_reset(float(reset))
    if not allowed:
        # Retry-After is whole seconds; a budget refusal is not cured by waiting.
        # A wait of 0.0 s (capacity due now) is a wait, not "no wait known": 1 s, not 60.
        headers["retry-after"] = (
            str(max(1, math.ceil(retry_after))) if retry_after is not None else "60"
        )
    month_tokens, month_spend = int(values[10]), int(values[11])
    alert = (token_budget > 0 and month_tokens >= soft_alert_fraction * token_budget) or (
        spend_budget > 0 and month_spend >= soft_alert_fraction * spend_budget
    )
    return Admission(
        allowed=allowed,
        error=values[1] or None,
        limit=values[2] or None,
        retry_after_s=retry_after,
        headers=headers,
        reservation=reservation if allowed else None,
        month_tokens_used=month_tokens,
        month_spend_micros=month_spend,
        budget_alert=alert,
    )
