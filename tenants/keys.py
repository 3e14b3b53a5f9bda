"""API keys on the gateway's hot path: the principal a key stands for, and its check.

Where a key's record lives, fastest first:
  1. an in-process cache of a few seconds (`KeyAuthenticator`), dropped on a pub/sub event;
  2. Redis, `apikey:<sha256 of the raw key>` -> JSON `{"secret_hash", "revoked", "principal"}`,
     written by the control plane whenever a key, its tenant or its quota changes (and after
     a PostgreSQL lookup on a Redis miss), with no expiry, so admitted keys keep working
     while PostgreSQL is down;
  3. PostgreSQL, only on a Redis miss.

A key PostgreSQL does not know is remembered as unknown too, so that repeating a made-up key
does not ask PostgreSQL each time: in the in-process cache like any other answer, and in
Redis as a tombstone that expires after `MISSING_KEY_TTL_S` (the key may be created later;
creating it overwrites the tombstone and publishes its event, so it works at once). A string
not shaped like a key this module generates is refused before any lookup.

Revocations and changes are published on `KEY_EVENTS_CHANNEL` as `key:<sha256>`,
`tenant:<id>` or `all`; every process drops the matching cache entries at once.

A change the control plane could not write to Redis (a revoke made while Redis was down is
in PostgreSQL only) must not be undone when Redis comes back with the key's old record. The
control plane cannot retry it through Celery (its broker is that same Redis) and keeps no
outbox, so the gateway repairs it: each time its key event channel is (re)subscribed, which
is what Redis coming back looks like from a gateway (and what a gateway starting looks like,
one that may have missed the outage), `KeyAuthenticator` takes PostgreSQL's word over
Redis's, once per key, on that key's next lookup: a revoked key is refused and its record
corrected in Redis (compare-and-set, so a newer write of the control plane wins). This lasts
until the control plane's periodic republish (`tenants.republish_key_records`, every 300 s)
announces with its `all` event that every record was rewritten from PostgreSQL, or
`RECHECK_WINDOW_S` at most; if PostgreSQL cannot answer, Redis is trusted as before.

This module imports nothing from Django: the PostgreSQL lookup is the caller's, injected as
`KeyAuthenticator(load_from_database=...)` (the gateway's composition root, `config.gateway`,
passes `tenants.actions.load_principal_from_database`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tenants.redis_calls import bounded, is_cluster

logger = logging.getLogger(__name__)
T = TypeVar("T")

KEY_RECORD_PREFIX = "apikey:"
KEY_EVENTS_CHANNEL = "tenants:key-events"
LAST_USED_HASH = "apikey:last-used"
KEY_SCHEME = "sk"
DEFAULT_TIMEOUT_S = 0.5
# How long every gateway process takes a key PostgreSQL did not know for unknown.
MISSING_KEY_TTL_S = 30
# After (re)subscribing to key events, keys are rechecked in PostgreSQL for at most this long
# (twice the control plane's periodic republish, which ends it sooner; see above).
RECHECK_WINDOW_S = 600.0
# SET KEYS[1] ARGV[2] only if it still holds ARGV[1]: a recheck's correction never overwrites
# a record the control plane wrote meanwhile.
_REPLACE_IF_UNCHANGED = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
PREFIX_BYTES = 4
SECRET_BYTES = 24


def key_shape(scheme: str, separator: str) -> re.Pattern[str]:
    """`<scheme><sep><prefix><sep><secret>`, both lowercase hex, as `generate_raw_key` makes
    them; the prefix is the first group. API keys are `sk-…-…`, staff tokens `pst_…_…`."""
    sep = re.escape(separator)
    return re.compile(
        rf"{re.escape(scheme)}{sep}([0-9a-f]{{{2 * PREFIX_BYTES}}}){sep}[0-9a-f]{{{2 * SECRET_BYTES}}}"
    )


_KEY_SHAPE = key_shape(KEY_SCHEME, "-")


@dataclass(frozen=True)
class EffectiveLimits:
    """A key's limits: the tenant's quota with the key's overrides merged (the lower wins).

    `requests_per_minute`, `tokens_per_minute` and `concurrent_streams` are the key's own
    ceilings; the `tenant_*` fields are the pool all the tenant's keys share (None: the same
    as the key's). `concurrent_streams` counts every request in flight, streamed or not (the
    name predates non-streamed requests holding a slot; see `tenants.limiter`). Budgets are the tenant's, per calendar month (UTC); None means no budget.
    """

    requests_per_minute: int
    tokens_per_minute: int
    concurrent_streams: int
    max_tokens_cap: int
    max_context_tokens: int
    monthly_token_budget: int | None
    monthly_spend_budget_usd: Decimal | None
    soft_alert_fraction: float
    hard_budget: bool
    tenant_requests_per_minute: int | None = None
    tenant_tokens_per_minute: int | None = None
    tenant_concurrent_streams: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "concurrent_streams": self.concurrent_streams,
            "max_tokens_cap": self.max_tokens_cap,
            "max_context_tokens": self.max_context_tokens,
            "monthly_token_budget": self.monthly_token_budget,
            "monthly_spend_budget_usd": (
                None
                if self.monthly_spend_budget_usd is None
                else str(self.monthly_spend_budget_usd)
            ),
            "soft_alert_fraction": self.soft_alert_fraction,
            "hard_budget": self.hard_budget,
            "tenant_requests_per_minute": self.tenant_requests_per_minute,
            "tenant_tokens_per_minute": self.tenant_tokens_per_minute,
            "tenant_concurrent_streams": self.tenant_concurrent_streams,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EffectiveLimits:
        spend = data.get("monthly_spend_budget_usd")
        return cls(
            requests_per_minute=int(data["requests_per_minute"]),
            tokens_per_minute=int(data["tokens_per_minute"]),
            concurrent_streams=int(data["concurrent_streams"]),
            max_tokens_cap=int(data["max_tokens_cap"]),
            max_context_tokens=int(data["max_context_tokens"]),
            monthly_token_budget=data.get("monthly_token_budget"),
            monthly_spend_budget_usd=None if spend is None else Decimal(str(spend)),
            soft_alert_fraction=float(data.get("soft_alert_fraction", 0.8)),
            hard_budget=bool(data.get("hard_budget", True)),
            tenant_requests_per_minute=data.get("tenant_requests_per_minute"),
            tenant_tokens_per_minute=data.get("tenant_tokens_per_minute"),
            tenant_concurrent_streams=data.get("tenant_concurrent_streams"),
        )


@dataclass(frozen=True)
class KeyPrincipal:
    """Who a request comes from, as the gateway needs it; plain data, cached and shipped as JSON.

    `tenant_status` may be "suspended": the gateway refuses such a tenant with a clear error
    (`is_usable` says whether to serve at all).
    """

    key_id: int
    key_prefix: str
    tenant_id: int
    tenant_slug: str
    tenant_status: str
    scopes: frozenset[str]
    model_allowlist: frozenset[str]
    expires_at: float | None
    fail_open: bool
    allowed_regions: frozenset[str]
    allowed_tiers: frozenset[str]
    limits: EffectiveLimits = field(compare=False)
    # The tenant's guardrail patterns (regular expressions), checked by the gateway.
    blocked_patterns: tuple[str, ...] = ()

    def is_expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    @property
    def is_usable(self) -> bool:
        return self.tenant_status == "active"

    def may_use_model(self, model: str) -> bool:
        return not self.model_allowlist or model in self.model_allowlist

    def to_dict(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "key_prefix": self.key_prefix,
            "tenant_id": self.tenant_id,
            "tenant_slug": self.tenant_slug,
            "tenant_status": self.tenant_status,
            "scopes": sorted(self.scopes),
            "model_allowlist": sorted(self.model_allowlist),
            "expires_at": self.expires_at,
            "fail_open": self.fail_open,
            "allowed_regions": sorted(self.allowed_regions),
            "allowed_tiers": sorted(self.allowed_tiers),
            "limits": self.limits.to_dict(),
            "blocked_patterns": list(self.blocked_patterns),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KeyPrincipal:
        return cls(
            key_id=int(data["key_id"]),
            key_prefix=str(data["key_prefix"]),
            tenant_id=int(data["tenant_id"]),
            tenant_slug=str(data["tenant_slug"]),
            tenant_status=str(data["tenant_status"]),
            scopes=frozenset(data.get("scopes", ())),
            model_allowlist=frozenset(data.get("model_allowlist", ())),
            expires_at=data.get("expires_at"),
            fail_open=bool(data.get("fail_open", False)),
            allowed_regions=frozenset(data.get("allowed_regions", ())),
            allowed_tiers=frozenset(data.get("allowed_tiers", ())),
            limits=EffectiveLimits.from_dict(data["limits"]),
            blocked_patterns=tuple(data.get("blocked_patterns", ())),
        )


def generate_raw_key(scheme: str = KEY_SCHEME, separator: str = "-") -> tuple[str, str]:
    """A new key `sk-<prefix>-<secret>` (or another scheme's) and its visible prefix."""
    prefix = secrets.token_hex(PREFIX_BYTES)
    return f"{scheme}{separator}{prefix}{separator}{secrets.token_hex(SECRET_BYTES)}", prefix


def key_prefix_of(raw_key: str, shape: re.Pattern[str] = _KEY_SHAPE) -> str | None:
    """The visible prefix of a string shaped like a key (`shape`: an API key's unless
    told); None for anything else."""
    shaped = shape.fullmatch(raw_key)
    return shaped.group(1) if shaped else None


def hash_key(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


def key_record_name(secret_hash: str) -> str:
    return KEY_RECORD_PREFIX + secret_hash


def encode_key_record(secret_hash: str, principal: KeyPrincipal | None) -> str:
    """The Redis record of a key; `principal=None` is a tombstone (revoked or gone)."""
    return json.dumps(
        {
            "secret_hash": secret_hash,
            "revoked": principal is None,
            "principal": None if principal is None else principal.to_dict(),
        }
    )


def principal_from_record(raw: str | bytes, secret_hash: str) -> KeyPrincipal | None:
    record = json.loads(raw)
    # The lookup was by hash already; compare in constant time anyway so no path ever
    # compares key material with an early exit.
    if not hmac.compare_digest(str(record.get("secret_hash", "")), secret_hash):
        return None
    if record.get("revoked") or record.get("principal") is None:
        return None
    return KeyPrincipal.from_dict(record["principal"])


# The key's principal from PostgreSQL (None: no such key), asked on a Redis miss only.
DatabaseLoader = Callable[[str], Awaitable[KeyPrincipal | None]]


@dataclass
class _CacheEntry:
    fresh_until: float
    principal: KeyPrincipal | None


class KeyAuthenticator:
    """Turns a raw API key into its `KeyPrincipal`, or None, without touching PostgreSQL on
    the hot path (see the module docstring for where records live)."""

    def __init__(
        self,
        redis: aioredis.Redis | aioredis.RedisCluster,
        *,
        load_from_database: DatabaseLoader,
        cache_ttl_s: float = 5.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        touch_flush_s: float = 5.0,
        cache_max_entries: int = 100_000,
    ) -> None:
        self._redis = redis
        self._cache_ttl_s = cache_ttl_s
        self._timeout_s = timeout_s
        # On a Redis Cluster a command is never cancelled mid-flight (tenants/redis_calls.py).
        self._shield = is_cluster(redis)
        self._touch_flush_s = touch_flush_s
        self._load_from_database = load_from_database
        # Bounded: made-up keys must not grow a process's memory without limit.
        self._cache: OrderedDict[str, _CacheEntry] = OrderedDict()
        self._cache_max_entries = cache_max_entries
        # Counts key events, so a lookup that an event overtook is not cached (below).
        self._events_seen = 0
        self._touched: dict[int, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._subscribed = asyncio.Event()
        # Until when (monotonic) keys admitted by Redis are rechecked in PostgreSQL, and those
        # rechecked since the last subscription (see the module docstring).
        self._recheck_until = 0.0
        self._rechecked: set[str] = set()
        self._replace_if_unchanged = redis.register_script(_REPLACE_IF_UNCHANGED)

    async def authenticate(self, raw_key: str) -> KeyPrincipal | None:
        if key_prefix_of(raw_key) is None:
            return None
        secret_hash = hash_key(raw_key)
        entry = self._cache.get(secret_hash)
        if entry is None or entry.fresh_until <= time.monotonic():
            events_seen = self._events_seen
            principal = await self._lookup(raw_key, secret_hash)
            entry = _CacheEntry(time.monotonic() + self._cache_ttl_s, principal)
            # An event during the lookup (the key created or revoked meanwhile) may have
            # made its answer stale: use it for this request, but do not cache it.
            if events_seen == self._events_seen:
                self._cache[secret_hash] = entry
                self._cache.move_to_end(secret_hash)
                while len(self._cache) > self._cache_max_entries:
                    self._cache.popitem(last=False)
        principal = entry.principal
        if principal is None or principal.is_expired(time.time()):
            return None
        return principal

    async def _lookup(self, raw_key: str, secret_hash: str) -> KeyPrincipal | None:
        redis_up = True
        try:
            raw = await self._bounded(self._redis.get(key_record_name(secret_hash)))
        except (RedisError, OSError, TimeoutError) as error:
            logger.warning("API key record unreadable from Redis (%s); asking PostgreSQL", error)
            raw, redis_up = None, False
        if raw is not None:
            principal = principal_from_record(raw, secret_hash)
            if principal is not None and self._must_recheck(secret_hash):
                return await self._recheck(raw_key, secret_hash, raw, principal)
            return principal
        principal = await self._load_from_database(raw_key)
        if redis_up:
            # Seed Redis so the next process to miss its cache need not ask PostgreSQL.
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await self._bounded(
                    # NX: a revocation written meanwhile by the control plane wins.
                    self._redis.set(
                        key_record_name(secret_hash),
                        encode_key_record(secret_hash, principal),
                        nx=True,
                        # an unknown key's tombstone expires: the key may be created later
                        ex=None if principal is not None else MISSING_KEY_TTL_S,
                    )
                )
        return principal

    async def _bounded(self, command: Awaitable[T]) -> T:
        return await bounded(command, self._timeout_s, shield=self._shield)

    def _must_recheck(self, secret_hash: str) -> bool:
        return time.monotonic() < self._recheck_until and secret_hash not in self._rechecked

    async def _recheck(
        self, raw_key: str, secret_hash: str, raw: str | bytes, admitted: KeyPrincipal
    ) -> KeyPrincipal | None:
        """PostgreSQL's answer for a key Redis admits, after Redis came back; Redis's record
        corrected when the two differ (a revoke or a suspension Redis never received)."""
        try:
            authority = await self._load_from_database(raw_key)
        except Exception as error:  # the injected loader's failure, whatever it raises
            logger.warning(
                "Could not recheck API keys in PostgreSQL (%s); trusting Redis's records", error
            )
            self._recheck_until = 0.0
            return admitted
        self._rechecked.add(secret_hash)
        record = encode_key_record(secret_hash, authority)
        if json.loads(record) != json.loads(raw):
            logger.warning(
                "API key sk-%s-… %s in PostgreSQL than in Redis; correcting Redis",
                admitted.key_prefix,
                "is revoked" if authority is None else "reads otherwise",
            )
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await self._bounded(
                    self._replace_if_unchanged(
                        keys=[key_record_name(secret_hash)], args=[raw, record]
                    )
                )
        return authority

    def forget(self, event: str) -> None:
        """Drop the cache entries an event names: `key:<hash>`, `tenant:<id>` or `all`."""
        self._events_seen += 1
        kind, _, value = event.partition(":")
        if kind == "key":
            self._cache.pop(value, None)
        elif kind == "tenant" and value.isdigit():
            tenant_id = int(value)
            for secret_hash, entry in list(self._cache.items()):
                if entry.principal is not None and entry.principal.tenant_id == tenant_id:
                    del self._cache[secret_hash]
        else:
            self._cache.clear()

    def touch(self, key_id: int) -> None:
        """Note that a key was used; written to Redis in batches, to PostgreSQL by a task."""
        self._touched[key_id] = time.time()

    async def flush_touches(self) -> None:
        if not self._touched:
            return
        batch, self._touched = self._touched, {}
        try:
            await self._bounded(
                self._redis.hset(LAST_USED_HASH, mapping={str(k): v for k, v in batch.items()})
            )
        except (RedisError, OSError, TimeoutError) as error:
            logger.warning("Could not record API key use in Redis: %s", error)
            for key_id, used_at in batch.items():
                self._touched.setdefault(key_id, used_at)

    async def start(self) -> None:
        """Follow key events (revocations, key and quota changes); returns once subscribed."""
        self._tasks.append(asyncio.create_task(self._follow_key_events()))
        self._tasks.append(asyncio.create_task(self._flush_touches_forever()))
        await asyncio.wait_for(self._subscribed.wait(), 5.0)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.flush_touches()

    async def _follow_key_events(self) -> None:
        backoff_s = 0.1
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(KEY_EVENTS_CHANNEL)
                self._resubscribed()
                # redis-py's pub/sub reconnects and subscribes again by itself when its retry
                # succeeds, without raising here: every such reconnect must count too.
                assert pubsub.connection is not None  # subscribed
                pubsub.connection.register_connect_callback(self._resubscribed)
                self._subscribed.set()
                backoff_s = 0.1
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message["type"] == "message":
                        data = message["data"]
                        event = data.decode() if isinstance(data, bytes) else str(data)
                        if event == "all":
                            # The periodic republish rewrote every record from PostgreSQL.
                            self._recheck_until = 0.0
                        self.forget(event)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, TimeoutError) as error:
                logger.warning("Lost the key event channel (%s); resubscribing", error)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)
            finally:
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # unannotated in redis-py

    def _resubscribed(self, _connection: object = None) -> None:
        """(Re)subscribed to key events. Events may have been missed meanwhile, and writes
        the control plane could not make: start from nothing, and recheck keys in
        PostgreSQL."""
        self.forget("all")
        self._recheck_until = time.monotonic() + RECHECK_WINDOW_S
        self._rechecked.clear()

    async def _flush_touches_forever(self) -> None:
        while True:
            await asyncio.sleep(self._touch_flush_s)
            await self.flush_touches()
