"""The router's in-memory view of the fleet, indexed so a decision never scans it.

Built once per routing-table version; telemetry, breaker changes and in-flight counts
update it in place. Replicas of a deployment are grouped by what makes them differ in
price and speed (GPU class, region, price, performance coefficients): inside a group they
differ only by load, so a few random draws (power of d choices) find a good one, and the
groups, sorted by price, are few.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from serving.router.contracts import (
    PROMPT_RATE_WINDOW_S,
    ModelRoute,
    ReplicaPerf,
    ReplicaState,
    RouterConfig,
)
from serving.router.predict import decay_factor, decayed_finish_count
from serving.router.prefix import PrefixIndex


def count_objective(objectives: dict[float, int], objective: float, change: int) -> bool:
    """Add `change` requests of TPOT `objective` to per-objective counts, never below zero;
    an objective with none left is dropped. Whether it was (its tightest then needs a look)."""
    count = objectives.get(objective, 0) + change
    if count > 0:
        objectives[objective] = count
        return False
    objectives.pop(objective, None)
    return True


def _take_unsynced(replica: ReplicaState, prompt_tokens: int) -> None:
    """One request of `prompt_tokens` no longer unsynced there (known to the other
    gateways, or finished before they knew of it)."""
    if replica.unsynced > 0:
        replica.unsynced -= 1
        replica.unsynced_prefill_tokens = max(0, replica.unsynced_prefill_tokens - prompt_tokens)


class ReplicaSet:
    """A set of replicas with O(1) add, remove and uniform random draw."""

    __slots__ = ("_position", "items")

    def __init__(self) -> None:
        self.items: list[ReplicaState] = []
        self._position: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(self.items)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._position

    def get(self, replica_id: str) -> ReplicaState | None:
        position = self._position.get(replica_id)
        return None if position is None else self.items[position]

    def add(self, replica: ReplicaState) -> None:
        if replica.replica_id in self._position:
            return
        self._position[replica.replica_id] = len(self.items)
        self.items.append(replica)

    def discard(self, replica_id: str) -> None:
        position = self._position.pop(replica_id, None)
        if position is None:
            return
        last = self.items.pop()
        if position < len(self.items):
            self.items[position] = last
            self._position[last.replica_id] = position


def queue_load(replica: ReplicaState) -> int:
    """Requests queued, running and in flight from here: what `LeastLoad` minimises."""
    return replica.waiting + replica.running + replica.inflight


class LoadBuckets:
    """Live replicas of one deployment bucketed by `queue_load`, loads kept sorted.

    Kept exact by `RouterState`'s writes, so the least-loaded replica is in the first
    bucket and a query visits buckets only until it finds one holding a candidate. The
    distinct loads are few (tens to hundreds), so the sorted list's insert and remove are
    short memmoves.
    """

    __slots__ = ("_load_of", "buckets", "loads")

    def __init__(self) -> None:
        self.buckets: dict[int, ReplicaSet] = {}
        # Ascending; exactly the keys of `buckets`, none of them empty.
        self.loads: list[int] = []
        self._load_of: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._load_of)

    def add(self, replica: ReplicaState) -> None:
        if replica.replica_id in self._load_of:
            self.update(replica)
            return
        self._put(replica, queue_load(replica))

    def discard(self, replica_id: str) -> None:
        load = self._load_of.pop(replica_id, None)
        if load is not None:
            self._take(replica_id, load)

    def update(self, replica: ReplicaState) -> None:
        """Re-bucket a member whose load may have changed; others are left out."""
        before = self._load_of.get(replica.replica_id)
        if before is None:
            return
        after = queue_load(replica)
        if after != before:
            self._take(replica.replica_id, before)
            self._put(replica, after)

    def _put(self, replica: ReplicaState, load: int) -> None:
        self._load_of[replica.replica_id] = load
        bucket = self.buckets.get(load)
        if bucket is None:
            bucket = self.buckets[load] = ReplicaSet()
            insort(self.loads, load)
        bucket.add(replica)

    def _take(self, replica_id: str, load: int) -> None:
        bucket = self.buckets[load]
        bucket.discard(replica_id)
        if not bucket:
            del self.buckets[load]
            del self.loads[bisect_left(self.loads, load)]


GroupKey = tuple[str, str, str, float, ReplicaPerf]


@dataclass(slots=True)
class ReplicaGroup:
    deployment_id: str
    gpu_class: str
    region: str
    price_per_hour: float
    perf: ReplicaPerf
    # Healthy members only; unhealthy replicas leave so draws are not wasted on them.
    live: ReplicaSet = field(default_factory=ReplicaSet)


class RouterState:
    def __init__(
        self,
        routes: Iterable[ModelRoute],
        replicas: Iterable[ReplicaState],
        *,
        version: int = 0,
        prefix_index: PrefixIndex | None = None,
        seed: int | None = None,
    ) -> None:
        self.version = version
        # Carried over between routing-table versions so affinity survives a republish.
        self.prefix_index = prefix_index if prefix_index is not None else PrefixIndex()
        self.rng = random.Random(seed)
        self._routes = {route.model: route for route in routes}
        self._replicas: dict[str, ReplicaState] = {}
        self._group_of: dict[str, ReplicaGroup] = {}
        self._groups: dict[str, list[ReplicaGroup]] = {}
        self._live: dict[str, ReplicaSet] = {}
        self._by_load: dict[str, LoadBuckets] = {}
        self._with_adapter: dict[tuple[str, str], ReplicaSet] = {}
        groups: dict[GroupKey, ReplicaGroup] = {}
        for replica in replicas:
            key = (
                replica.deployment_id,
                replica.gpu_class,
                replica.region,
                replica.price_per_hour,
                replica.perf,
            )
            group = groups.get(key)
            if group is None:
                group = ReplicaGroup(*key)
                groups[key] = group
                self._groups.setdefault(replica.deployment_id, []).append(group)
            self._replicas[replica.replica_id] = replica
            self._group_of[replica.replica_id] = group
            self.prefix_index.hold_at_most(replica.replica_id, replica.perf.kv_capacity_tokens)
            self._live.setdefault(replica.deployment_id, ReplicaSet())
            self._by_load.setdefault(replica.deployment_id, LoadBuckets())
            if replica.healthy:
                self._join(replica)
        for deployment_groups in self._groups.values():
            deployment_groups.sort(key=lambda group: group.price_per_hour)

    # Reads, all O(1).

    def route(self, model: str) -> ModelRoute | None:
        return self._routes.get(model)

    def replica(self, replica_id: str) -> ReplicaState | None:
        return self._replicas.get(replica_id)

    def groups(self, deployment_id: str) -> list[ReplicaGroup]:
        """Groups of the deployment, cheapest first."""
        return self._groups.get(deployment_id, [])

    def live(self, deployment_id: str) -> ReplicaSet:
        return self._live.get(deployment_id) or ReplicaSet()

    def by_load(self, deployment_id: str) -> LoadBuckets:
        """The deployment's live replicas bucketed by `queue_load`."""
        return self._by_load.get(deployment_id) or LoadBuckets()

    def with_adapter(self, deployment_id: str, adapter: str) -> ReplicaSet | None:
        return self._with_adapter.get((deployment_id, adapter))

    def __len__(self) -> int:
        return len(self._replicas)

    # Writes: telemetry, breaker, in-flight.

    def update_telemetry(
        self,
        replica_id: str,
        *,
        running: int,
        waiting: int,
        kv_usage: float,
        telemetry_at: float,
        adapters_loaded: frozenset[str] | None = None,
        max_loras: int | None = None,
        healthy: bool | None = None,
    ) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return  # not in this routing-table version; the next one will carry it
        replica.running = running
        replica.waiting = waiting
        replica.kv_usage = kv_usage
        replica.telemetry_at = telemetry_at
        if max_loras is not None:
            replica.max_loras = max_loras
        if adapters_loaded is not None and adapters_loaded != replica.adapters_loaded:
            if replica.healthy:
                self._index_adapters(replica, replica.adapters_loaded, adapters_loaded)
            replica.adapters_loaded = adapters_loaded
        if healthy is not None and healthy != replica.healthy:
            replica.healthy = healthy
            if healthy:
                self._join(replica)
            else:
                self._leave(replica)
        elif replica.healthy:
            self._by_load[replica.deployment_id].update(replica)

    def set_breaker(self, replica_id: str, open_until: float) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.breaker_open_until = open_until

    def request_started(
        self,
        replica_id: str,
        prompt_tokens: int = 0,
        now: float | None = None,
        *,
        context_tokens: int = 0,
        tpot_objective_s: float | None = None,
        unsynced: bool = False,
    ) -> None:
        """A request was sent there, by this gateway or, as another gateway told it, by
        that one: `prompt_tokens` is the prefill it needs (prompt less what the router
        expects cached, `Decision.cached_tokens`); `now` (monotonic seconds) feeds the
        replica's prompt-token rate, left alone without it; `context_tokens` is its whole
        prompt, the KV its decode steps read; `tpot_objective_s` its tier's TPOT
        objective, which requests sent there later must not push the replica's decode
        steps past (None: it has none); `unsynced`, this gateway sent it and the others
        do not know of it yet (until `request_synced`)."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        replica.inflight += 1
        if unsynced:
            replica.unsynced += 1
            replica.unsynced_prefill_tokens += prompt_tokens
        if tpot_objective_s is not None:
            count_objective(replica.inflight_tpot_objectives, tpot_objective_s, 1)
            if tpot_objective_s < replica.tightest_tpot_s:
                replica.tightest_tpot_s = tpot_objective_s
        if replica.healthy:
            self._by_load[replica.deployment_id].update(replica)
        replica.inflight_prompt_tokens += prompt_tokens
        replica.inflight_context_tokens += context_tokens
        replica.prefill_pending_tokens += prompt_tokens
        if now is not None and not replica.finish_rate_since:
            replica.finish_rate_since = now
        if now is not None and prompt_tokens:
            # Both averages decay from `prompt_rate_at`, so their ratio is the mean prompt.
            decay = decay_factor(replica.prompt_rate_at, now)
            replica.prompt_rate = replica.prompt_rate * decay + prompt_tokens / PROMPT_RATE_WINDOW_S
            replica.prefill_rate = replica.prefill_rate * decay + 1.0 / PROMPT_RATE_WINDOW_S
            replica.prompt_rate_at = now

    def request_synced(self, replica_id: str, prompt_tokens: int = 0) -> None:
        """The other gateways now know of a request this one started `unsynced` (pass the
        same `prompt_tokens`)."""
        replica = self._replicas.get(replica_id)
        if replica is not None:
            _take_unsynced(replica, prompt_tokens)

    def adjust_inflight(
        self,
        replica_id: str,
        *,
        inflight: int = 0,
        prompt_tokens: int = 0,
        context_tokens: int = 0,
        prefill_pending_tokens: int = 0,
        tpot_objectives: Mapping[float, int] | None = None,
    ) -> None:
        """Correct the replica's in-flight counts by these differences (another gateway's
        own counts, as it last published them, against what its starts and finishes
        added up to here; or all of them taken away when it is gone). Never below zero."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        replica.inflight = max(0, replica.inflight + inflight)
        replica.inflight_prompt_tokens = max(0, replica.inflight_prompt_tokens + prompt_tokens)
        replica.inflight_context_tokens = max(0, replica.inflight_context_tokens + context_tokens)
        replica.prefill_pending_tokens = max(
            0, replica.prefill_pending_tokens + prefill_pending_tokens
        )
        if tpot_objectives:
            objectives = replica.inflight_tpot_objectives
            for objective, change in tpot_objectives.items():
                count_objective(objectives, objective, change)
            replica.tightest_tpot_s = min(objectives, default=math.inf)
        if replica.healthy:
            self._by_load[replica.deployment_id].update(replica)

    def request_first_token(self, replica_id: str, prompt_tokens: int) -> None:
        """Its first token came back: the prompt is no longer prefill work queued there."""
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.prefill_pending_tokens = max(0, replica.prefill_pending_tokens - prompt_tokens)

    def observe_ttft(
        self,
        replica_id: str,
        observed_s: float,
        predicted_s: float | None,
        scale: float | None,
        config: RouterConfig,
    ) -> None:
        """A request this gateway sent there had its first token `observed_s` after it was
        routed, where the decision predicted `predicted_s` with the replica's `ttft_scale`
        at `scale` (`Decision.predicted_ttft_s` and `Decision.ttft_scale`): the scale takes
        a step of a running quantile of observed over predicted (`config.ttft_quantile`),
        the prediction taken without the scale it carried, so the scale learns the model's
        error and not its own."""
        quantile = config.ttft_quantile
        if quantile is None or predicted_s is None or scale is None or scale <= 0.0:
            return
        replica = self._replicas.get(replica_id)
        unscaled = predicted_s / scale
        if replica is None or unscaled < config.ttft_calibration_min_s:
            return
        current = replica.ttft_scale
        below = 1.0 if observed_s < unscaled * current else 0.0
        current += config.ttft_quantile_step * (quantile - below)
        low, high = config.ttft_scale_bounds
        replica.ttft_scale = low if current < low else high if current > high else current

    def request_finished(
        self,
        replica_id: str,
        prompt_tokens: int = 0,
        *,
        first_token_seen: bool = True,
        context_tokens: int = 0,
        now: float | None = None,
        tpot_objective_s: float | None = None,
        unsynced: bool = False,
    ) -> None:
        """Pass the same `prompt_tokens`, `context_tokens` and `tpot_objective_s` as to
        `request_started`; `first_token_seen=False` for a request that ended (error, abort)
        before `request_first_token`; `now` (monotonic seconds) feeds the replica's finish
        rate, left alone without it; `unsynced` when it was started so and never
        `request_synced`."""
        replica = self._replicas.get(replica_id)
        if replica is None or replica.inflight <= 0:
            return
        replica.inflight -= 1
        if unsynced:
            _take_unsynced(replica, prompt_tokens)
        if tpot_objective_s is not None:
            objectives = replica.inflight_tpot_objectives
            if (
                count_objective(objectives, tpot_objective_s, -1)
                and tpot_objective_s == replica.tightest_tpot_s
            ):
                replica.tightest_tpot_s = min(objectives, default=math.inf)
        if replica.healthy:
            self._by_load[replica.deployment_id].update(replica)
        replica.inflight_prompt_tokens = max(0, replica.inflight_prompt_tokens - prompt_tokens)
        replica.inflight_context_tokens = max(0, replica.inflight_context_tokens - context_tokens)
        if not first_token_seen:
            replica.prefill_pending_tokens = max(0, replica.prefill_pending_tokens - prompt_tokens)
        elif now is not None:
            replica.finish_rate = decayed_finish_count(replica, now) + 1.0 / PROMPT_RATE_WINDOW_S
            replica.finish_rate_at = now

    def _join(self, replica: ReplicaState) -> None:
        self._group_of[replica.replica_id].live.add(replica)
        self._live[replica.deployment_id].add(replica)
        self._by_load[replica.deployment_id].add(replica)
        self._index_adapters(replica, frozenset(), replica.adapters_loaded)

    def _leave(self, replica: ReplicaState) -> None:
        self._group_of[replica.replica_id].live.discard(replica.replica_id)
        self._live[replica.deployment_id].discard(replica.replica_id)
        self._by_load[replica.deployment_id].discard(replica.replica_id)
        self._index_adapters(replica, replica.adapters_loaded, frozenset())

    def _index_adapters(
        self, replica: ReplicaState, before: frozenset[str], after: frozenset[str]
    ) -> None:
        for adapter in before - after:
            holders = self._with_adapter.get((replica.deployment_id, adapter))
            if holders is not None:
                holders.discard(replica.replica_id)
        for adapter in after - before:
            key = (replica.deployment_id, adapter)
            holders = self._with_adapter.get(key)
            if holders is None:
                holders = self._with_adapter[key] = ReplicaSet()
            holders.add(replica)
