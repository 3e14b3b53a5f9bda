"""The gateways' in-flight counts kept in step through Redis pub/sub.

A gateway's router predicts a replica's TTFT and TPOT from the requests in flight there;
with N gateways each knew only its own and scaled them by N (`RouterConfig.gateways`), so
on a few replicas all N sent to the same one between two telemetry scrapes (chat on 23
L40S with 16 gateways: 100 % of interactive requests within both clocks -> 62 %,
bench/RESULTS.md). Each gateway now publishes every start, first token and finish it
counts, and applies the others' to its own `RouterState` as they arrive, so its counts are
everyone's but for the last message in transit. What it sent that the others do not know
yet it marks `unsynced` (the router takes it `gateways` times over) until its own message
comes back on the channel, which is when the others have it too.

Messages, on one channel, each gateway's in the order it sent them:

    {"g": gateway id, "e": [event, ...]}        events, batched while a publish is out
        ["s", replica, prefill, context, tpot]  started (tpot: objective or null)
        ["f", replica, prefill]                 first token
        ["x", replica, prefill, context, tpot, first_token_seen]   finished
    {"g": gateway id, "c": {replica: [inflight, prefill, context, pending, [[tpot, n]]]},
     "n": snapshot number}                      its own counts, every `snapshot_s`

Pub/sub delivers at most once: a gateway that reconnects misses messages, and one that
dies never sends its finishes. So each gateway also keeps, per other gateway, what that
one's events added up to, and every `snapshot_s` each publishes its own counts: where a
snapshot and the sum differ, the difference is corrected (`RouterState.adjust_inflight`),
and a gateway silent for `silent_s` has its counts taken away. Redis away: nothing is
synced, everything a gateway sends stays unsynced, and its router falls back to taking its
own counts N times over.

A start whose message was lost that way (dropped while Redis was away, or past
`MAX_PENDING`) never comes back on the channel, so it would stay unsynced, counted N times
over, until it finished: for minutes after a blip of seconds, on a gateway whose telemetry
is fresh again, and its admission queue would hold requests on that over-count. The next
snapshot to reach the channel carries it (a snapshot is every request this gateway has in
flight, and the others correct their sums to it), so when that snapshot comes back, the
lost starts it covers are synced. Snapshots carry a number (`"n"`) for this; the others
ignore it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis

from serving.gateway.background import cancel_all, follow_channel, repeat
from serving.router import RouterState
from serving.router.index import count_objective

log = logging.getLogger(__name__)

INFLIGHT_CHANNEL = "routing:inflight"
SNAPSHOT_S = 1.0  # own counts republished this often: a lost message is mended within it
SILENT_S = 10.0  # a gateway not heard from for this long is gone (as gateway:alive counts)
MAX_BATCH = 1024  # events a message carries at most
MAX_PENDING = 16 * MAX_BATCH  # Redis away: stop queueing; what is dropped is lost
MAX_COVERED = 8  # snapshots awaiting their echo; an older one's lost starts go to the next


@dataclass(slots=True)
class Counts:
    """One gateway's requests in flight on one replica."""

    inflight: int = 0
    prefill: int = 0  # prompt tokens to prefill (prompt less the expected cache)
    context: int = 0  # whole prompts
    pending: int = 0  # prefill of those still without their first token
    objectives: dict[float, int] = field(default_factory=dict)

    def started(self, prefill: int, context: int, tpot: float | None) -> None:
        self.inflight += 1
        self.prefill += prefill
        self.context += context
        self.pending += prefill
        if tpot is not None:
            count_objective(self.objectives, tpot, 1)

    def first_token(self, prefill: int) -> None:
        self.pending = max(0, self.pending - prefill)

    def finished(self, prefill: int, context: int, tpot: float | None, seen: bool) -> None:
        self.inflight = max(0, self.inflight - 1)
        self.prefill = max(0, self.prefill - prefill)
        self.context = max(0, self.context - context)
        if not seen:
            self.pending = max(0, self.pending - prefill)
        if tpot is not None:
            count_objective(self.objectives, tpot, -1)

    @property
    def empty(self) -> bool:
        return not (self.inflight or self.prefill or self.context or self.pending)

    def encode(self) -> list[Any]:
        objectives = [[tpot, n] for tpot, n in self.objectives.items()]
        return [self.inflight, self.prefill, self.context, self.pending, objectives]

    @classmethod
    def decode(cls, raw: list[Any]) -> Counts:
        inflight, prefill, context, pending, objectives = raw
        return cls(
            int(inflight),
            int(prefill),
            int(context),
            int(pending),
            {float(tpot): int(n) for tpot, n in objectives},
        )


class InflightSync:
    def __init__(
        self,
        redis: aioredis.Redis | aioredis.RedisCluster,
        gateway_id: str,
        state: Callable[[], RouterState],
        *,
        channel: str = INFLIGHT_CHANNEL,
        snapshot_s: float = SNAPSHOT_S,
        silent_s: float = SILENT_S,
    ) -> None:
        self.redis = redis
        self.gateway_id = gateway_id
        self.state = state  # the current routing snapshot's state (counts carried over)
        self.channel = channel
        self.snapshot_s = snapshot_s
        self.silent_s = silent_s
        self.own: dict[str, Counts] = {}
        # Per other gateway: its counts as its messages added them up, and when it was last
        # heard from (monotonic seconds).
        self.others: dict[str, dict[str, Counts]] = {}
        self.heard: dict[str, float] = {}
        # This gateway's starts the others do not know of yet, (replica, prefill) -> how
        # many: queued or published, not yet back on the channel.
        self.unsynced: dict[tuple[str, int], int] = {}
        # Of those, the ones whose start message was lost (Redis away): the next snapshot
        # that comes back syncs them. Per snapshot published, the lost starts it covers.
        self.lost: dict[tuple[str, int], int] = {}
        self._covered: dict[int, dict[tuple[str, int], int]] = {}
        self._snapshots = 0
        self._pending: list[list[Any]] = []
        self._wake = asyncio.Event()
        # One publish at a time, so the channel carries this gateway's messages in the order
        # it made them (a snapshot after the events it counts).
        self._publishing = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self.subscribed = asyncio.Event()

    # --- this gateway's counts ------------------------------------------------------------

    def started(
        self, replica_id: str, prefill: int, context: int, tpot_objective_s: float | None
    ) -> None:
        """Count a request this gateway sent (the router counted it `unsynced`)."""
        self.own.setdefault(replica_id, Counts()).started(prefill, context, tpot_objective_s)
        key = (replica_id, prefill)
        self.unsynced[key] = self.unsynced.get(key, 0) + 1
        self._queue(["s", replica_id, prefill, context, tpot_objective_s])

    def first_token(self, replica_id: str, prefill: int) -> None:
        counts = self.own.get(replica_id)
        if counts is not None:
            counts.first_token(prefill)
        self._queue(["f", replica_id, prefill])

    def finished(
        self,
        replica_id: str,
        prefill: int,
        context: int,
        tpot_objective_s: float | None,
        first_token_seen: bool,
    ) -> bool:
        """Count its finish; whether its start was still unsynced (tell the router so)."""
        counts = self.own.get(replica_id)
        if counts is not None:
            counts.finished(prefill, context, tpot_objective_s, first_token_seen)
            if counts.empty:
                del self.own[replica_id]
        unsynced = self._take_unsynced(replica_id, prefill)
        self._queue(["x", replica_id, prefill, context, tpot_objective_s, first_token_seen])
        return unsynced

    def _take_unsynced(self, replica_id: str, prefill: int) -> bool:
        key = (replica_id, prefill)
        left = self.unsynced.get(key, 0) - 1
        if left < 0:
            return False
        if left:
            self.unsynced[key] = left
        else:
            del self.unsynced[key]
        if self.lost.get(key, 0) > left:
            self._set_lost(key, left)  # never more lost than unsynced: bounded by what is in flight
        return True

    def _set_lost(self, key: tuple[str, int], count: int) -> None:
        if count > 0:
            self.lost[key] = count
        else:
            self.lost.pop(key, None)

    def _queue(self, event: list[Any]) -> None:
        if len(self._pending) < MAX_PENDING:  # Redis away: drop, not grow
            self._pending.append(event)
            self._wake.set()
        else:
            self._lose([event])

    def _lose(self, events: list[list[Any]]) -> None:
        """These events will not reach the channel: count their starts as lost (those still
        unsynced). A publish that timed out may have gone after all; its batch then comes
        back too and syncs its starts, and the covering snapshot syncs as many others of the
        same replica and prefill a moment early, whose messages are on their way or lost."""
        for event in events:
            if event[0] == "s":
                key = (event[1], event[2])
                self._set_lost(key, min(self.lost.get(key, 0) + 1, self.unsynced.get(key, 0)))

    # --- publishing -----------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._publish_forever(), name="inflight-publish"),
            asyncio.create_task(self._snapshot_forever(), name="inflight-snapshot"),
            asyncio.create_task(self._follow_forever(), name="inflight-follow"),
        ]

    async def close(self) -> None:
        await cancel_all(self._tasks)

    async def flush(self) -> None:
        """Publish what is queued, in batches, in order."""
        async with self._publishing:
            await self._flush()

    async def publish_snapshot(self) -> None:
        async with self._publishing:
            await self._flush()  # the events first: the snapshot counts them
            counts = {replica_id: c.encode() for replica_id, c in self.own.items()}
            self._snapshots += 1
            number, covered, self.lost = self._snapshots, self.lost, {}
            if covered:  # before the publish: its echo may arrive before the publish returns
                self._covered[number] = covered
            message = orjson.dumps({"g": self.gateway_id, "c": counts, "n": number})
            try:
                await self.redis.publish(self.channel, message)
            except BaseException:
                self._relose(self._covered.pop(number, {}))  # the next snapshot covers them
                raise
            while len(self._covered) > MAX_COVERED:  # echoes not heard (unsubscribed)
                self._relose(self._covered.pop(min(self._covered)))

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            try:
                await self.redis.publish(
                    self.channel, orjson.dumps({"g": self.gateway_id, "e": batch})
                )
            except BaseException:
                self._lose(batch)
                raise

    async def _publish_forever(self) -> None:
        # No timer: a publish goes out as soon as the last one is done, carrying whatever
        # queued meanwhile, so a quiet gateway's events leave at once and a busy one's batch.
        await repeat(
            self._woken,
            self.flush,
            "publish in-flight counts",
            on_error=self._drop_pending,
            backoff_s=1.0,
        )

    def _relose(self, covered: dict[tuple[str, int], int]) -> None:
        """Back to `lost`, for the next snapshot to cover (as many as are still unsynced)."""
        for key, count in covered.items():
            self._set_lost(key, min(self.lost.get(key, 0) + count, self.unsynced.get(key, 0)))

    def _drop_pending(self) -> None:
        self._lose(self._pending)  # Redis away: unsynced until a snapshot comes back
        self._pending = []

    async def _woken(self) -> None:
        await self._wake.wait()
        self._wake.clear()

    async def _snapshot_forever(self) -> None:
        await repeat(
            lambda: asyncio.sleep(self.snapshot_s), self._snapshot, "publish in-flight counts"
        )

    async def _snapshot(self) -> None:
        try:
            await self.publish_snapshot()
        finally:
            self.forget_silent(time.monotonic())

    # --- the others' counts ---------------------------------------------------------------

    async def _follow_forever(self) -> None:
        await follow_channel(self.redis, self.channel, self._on_message, subscribed=self.subscribed)

    async def _on_message(self, raw: bytes) -> None:
        try:
            self.apply(raw, time.monotonic())
        except (ValueError, TypeError, KeyError) as error:
            log.warning("a malformed in-flight message: %s", error)

    def apply(self, raw: bytes | str, now: float) -> int:
        """Apply a message from the channel; how many events or replicas it carried (of this
        gateway's own, how many starts it synced). Raises ValueError (or TypeError,
        KeyError) for a malformed one, changing nothing."""
        message = orjson.loads(raw)
        if not isinstance(message, dict) or not isinstance(message.get("g"), str):
            raise ValueError("an in-flight message is a JSON object with a gateway id")
        origin = message["g"]
        if "e" in message:
            events = [_event(item) for item in message["e"]]  # all checked before any applied
            if origin == self.gateway_id:
                return self._synced(events)
            self.heard[origin] = now
            counts = self.others.setdefault(origin, {})
            state = self.state()
            for event in events:
                _apply_event(state, counts, event, now)
            return len(events)
        if "c" in message:
            snapshot = {str(r): Counts.decode(c) for r, c in dict(message["c"]).items()}
            if origin == self.gateway_id:
                return self._snapshot_returned(message.get("n"))
            self.heard[origin] = now
            self._correct(origin, snapshot)
            return len(snapshot)
        raise ValueError("an in-flight message carries events or counts")

    def _synced(self, events: list[tuple[Any, ...]]) -> int:
        """This gateway's own batch came back: the others have its starts now."""
        state = self.state()
        synced = 0
        for event in events:
            if event[0] == "s" and self._take_unsynced(event[1], event[2]):
                state.request_synced(event[1], event[2])
                synced += 1
        return synced

    def _snapshot_returned(self, number: Any) -> int:
        """This gateway's snapshot `number` came back: the others have every request it had
        in flight, the lost starts of this snapshot and of earlier ones (which it counts
        too) included. Sync those still unsynced; how many."""
        if not isinstance(number, int):
            return 0
        state = self.state()
        synced = 0
        for covered_by in [n for n in self._covered if n <= number]:
            for (replica_id, prefill), lost in self._covered.pop(covered_by).items():
                # A lost start that finished took its own unsynced count already. With a
                # newer start of the same replica and prefill in flight, this syncs that one
                # instead, a moment early if its message is on its way.
                for _ in range(lost):
                    if not self._take_unsynced(replica_id, prefill):
                        break
                    state.request_synced(replica_id, prefill)
                    synced += 1
        return synced

    def _correct(self, origin: str, snapshot: dict[str, Counts]) -> None:
        counts = self.others.setdefault(origin, {})
        state = self.state()
        for replica_id in set(counts) | set(snapshot):
            before = counts.get(replica_id) or Counts()
            after = snapshot.get(replica_id) or Counts()
            if before != after:
                _adjust(state, replica_id, before, after)
            if after.empty:
                counts.pop(replica_id, None)
            else:
                counts[replica_id] = after

    def forget_silent(self, now: float) -> list[str]:
        """Take away the counts of gateways not heard from for `silent_s`; which."""
        gone = [g for g, at in self.heard.items() if now - at > self.silent_s]
        for origin in gone:
            self._correct(origin, {})
            del self.others[origin]
            del self.heard[origin]
            log.info("gateway %s went silent: its requests in flight are forgotten", origin)
        return gone


def _event(item: Any) -> tuple[Any, ...]:
    kind = item[0]
    if kind == "s":
        _, replica_id, prefill, context, tpot = item
        return ("s", str(replica_id), int(prefill), int(context), _objective(tpot))
    if kind == "f":
        _, replica_id, prefill = item
        return ("f", str(replica_id), int(prefill))
    if kind == "x":
        _, replica_id, prefill, context, tpot, seen = item
        return ("x", str(replica_id), int(prefill), int(context), _objective(tpot), bool(seen))
    raise ValueError(f"unknown in-flight event {kind!r}")


def _objective(value: Any) -> float | None:
    return None if value is None else float(value)


def _apply_event(
    state: RouterState, counts: dict[str, Counts], event: tuple[Any, ...], now: float
) -> None:
    kind, replica_id, prefill = event[0], event[1], event[2]
    mine = counts.setdefault(replica_id, Counts())
    if (kind == "x" and not mine.inflight) or (kind == "f" and not mine.pending):
        # Its start came before this gateway listened (or was lost): what the router
        # never counted it must not take away; the next snapshot settles the rest.
        if mine.empty:
            del counts[replica_id]
        return
    if kind == "s":
        _, _, _, context, tpot = event
        mine.started(prefill, context, tpot)
        state.request_started(
            replica_id, prefill, now, context_tokens=context, tpot_objective_s=tpot
        )
    elif kind == "f":
        mine.first_token(prefill)
        state.request_first_token(replica_id, prefill)
    else:
        _, _, _, context, tpot, seen = event
        mine.finished(prefill, context, tpot, seen)
        state.request_finished(
            replica_id,
            prefill,
            first_token_seen=seen,
            context_tokens=context,
            now=now,
            tpot_objective_s=tpot,
        )
    if mine.empty:
        del counts[replica_id]


def _adjust(state: RouterState, replica_id: str, before: Counts, after: Counts) -> None:
    objectives = {
        tpot: after.objectives.get(tpot, 0) - before.objectives.get(tpot, 0)
        for tpot in set(before.objectives) | set(after.objectives)
    }
    state.adjust_inflight(
        replica_id,
        inflight=after.inflight - before.inflight,
        prompt_tokens=after.prefill - before.prefill,
        context_tokens=after.context - before.context,
        prefill_pending_tokens=after.pending - before.pending,
        tpot_objectives={tpot: n for tpot, n in objectives.items() if n},
    )
