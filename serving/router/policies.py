"""Routing policies behind one interface: `choose(request, now) -> Decision`.

Every policy applies the same hard filters (health, breaker, telemetry age, allowed
regions, adapter support, prompt fits in KV), picks the deployment by canary weight first,
falls back to the other weighted deployments when the chosen one has no candidate, and
records the request's prefix against the chosen replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from serving.router.canary import deployments_in_order
from serving.router.contracts import (
    PROMPT_RATE_WINDOW_S,
    Decision,
    Reason,
    ReplicaPerf,
    ReplicaState,
    RouterConfig,
    RouteRequest,
    SloTier,
)
from serving.router.index import LoadBuckets, ReplicaGroup, ReplicaSet, RouterState
from serving.router.predict import Prediction, is_candidate, predict


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, now: float) -> Decision: ...


def _meets(prediction: Prediction, tier: SloTier) -> bool:
    return (tier.ttft_s is None or prediction.ttft_s <= tier.ttft_s) and (
        tier.tpot_s is None or prediction.tpot_s <= tier.tpot_s
    )


def _slo_violation(ttft_s: float, tpot_s: float, tier: SloTier) -> float:
    """How many times over its objective a prediction is (<= 1 means it meets it)."""
    ratio = 0.0
    if tier.ttft_s is not None:
        ratio = ttft_s / tier.ttft_s
    if tier.tpot_s is not None:
        ratio = max(ratio, tpot_s / tier.tpot_s)
    return ratio


def _no_route(request: RouteRequest, state: RouterState, policy: str) -> Decision:
    reason = Reason.UNKNOWN_MODEL if state.route(request.model) is None else Reason.NO_CANDIDATES
    return Decision(None, reason, policy)


def _decide(
    state: RouterState,
    config: RouterConfig,
    request: RouteRequest,
    now: float,
    replica: ReplicaState,
    reason: Reason,
    policy: str,
    cached_blocks: int = 0,
) -> Decision:
    prediction = predict(replica, request, now, config, cached_blocks)
    if request.prefix_hashes:
        state.prefix_index.record(request.tenant, request.prefix_hashes, replica.replica_id)
    return Decision(
        replica,
        reason,
        policy,
        deployment_id=replica.deployment_id,
        predicted_ttft_s=prediction.ttft_s,
        predicted_tpot_s=prediction.tpot_s,
        predicted_cost_usd=prediction.cost_usd,
        cached_tokens=cached_blocks * config.prefix_block_tokens,
        meets_slo=_meets(prediction, config.tier(request.tier)),
    )


class RoundRobin:
    name = "round_robin"

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self.config = config or RouterConfig()
        self._next: dict[str, int] = {}

    def choose(self, request: RouteRequest, now: float) -> Decision:
        route = self.state.route(request.model)
        if route is None:
            return _no_route(request, self.state, self.name)
        for deployment in deployments_in_order(route, request):
            live = self.state.live(deployment.deployment_id).items
            start = self._next.get(deployment.deployment_id, 0)
            for step in range(len(live)):
                replica = live[(start + step) % len(live)]
                if is_candidate(replica, request, now, self.config):
                    self._next[deployment.deployment_id] = start + step + 1
                    return _decide(
                        self.state,
                        self.config,
                        request,
                        now,
                        replica,
                        Reason.ROUND_ROBIN,
                        self.name,
                    )
        return _no_route(request, self.state, self.name)


class LeastLoad:
    """Fewest requests queued, running and in flight from here (`queue_load`).

    Exact without a scan: `RouterState.by_load` keeps each deployment's live replicas in
    buckets by load, so the search walks buckets from the lightest and stops at the first
    one holding a candidate. The time-dependent filters (breaker, telemetry age) and the
    request's own (regions, adapter, prompt size) are checked per replica as it is
    visited, so a replica they exclude is skipped and the walk goes on: the answer is
    the scan's, and only a request that excludes most light replicas pays for a long walk.
    Ties: a random member of the lightest bucket holding a candidate (the bucket's
    candidates in cyclic order from a random start, the first taken).
    """

    name = "least_load"

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self.config = config or RouterConfig()

    def choose(self, request: RouteRequest, now: float) -> Decision:
        route = self.state.route(request.model)
        if route is None:
            return _no_route(request, self.state, self.name)
        for deployment in deployments_in_order(route, request):
            best = self._lightest(self.state.by_load(deployment.deployment_id), request, now)
            if best is not None:
                return _decide(
                    self.state, self.config, request, now, best, Reason.LEAST_LOAD, self.name
                )
        return _no_route(request, self.state, self.name)

    def _lightest(
        self, by_load: LoadBuckets, request: RouteRequest, now: float
    ) -> ReplicaState | None:
        config = self.config
        random = self.state.rng.random
        buckets = by_load.buckets
        for load in by_load.loads:
            members = buckets[load].items
            size = len(members)
            # A random starting point so equal loads do not all land on one replica.
            start = int(random() * size)
            for position in range(start, start + size):
                replica = members[position % size]
                if is_candidate(replica, request, now, config):
                    return replica
        return None


@dataclass(slots=True, frozen=True)
class ScorerWeights:
    """llm-d's default endpoint-picker profile."""

    queue: float = 2.0
    kv_cache: float = 2.0
    prefix: float = 3.0


class WeightedScorer:
    """Queue + KV-cache utilisation + prefix scorers, weighted, highest total wins.

    Normalised as llm-d's scorers do: queue is min-max over the candidates' waiting
    queues (shortest 1, longest 0, all equal 1); KV is 1 - kv_usage; prefix is the
    fraction of the request's blocks the replica holds as a leading run. Ties are broken
    at random. Above `max_scored` candidates we score a random sample plus every prefix
    holder, since min-max over thousands of replicas per request costs milliseconds.
    """

    name = "weighted_scorer"

    def __init__(
        self,
        state: RouterState,
        config: RouterConfig | None = None,
        weights: ScorerWeights | None = None,
        max_scored: int = 32,
    ) -> None:
        self.state = state
        self.config = config or RouterConfig()
        self.weights = weights or ScorerWeights()
        self.max_scored = max_scored

    def choose(self, request: RouteRequest, now: float) -> Decision:
        route = self.state.route(request.model)
        if route is None:
            return _no_route(request, self.state, self.name)
        matches = (
            self.state.prefix_index.longest_matches(request.tenant, request.prefix_hashes)
            if request.prefix_hashes
            else {}
        )
        for deployment in deployments_in_order(route, request):
            live = self.state.live(deployment.deployment_id)
            candidates = _candidates(self._pool(live, matches), request, now, self.config)
            if candidates:
                replica = self._best(candidates, matches, len(request.prefix_hashes))
                return _decide(
                    self.state,
                    self.config,
                    request,
                    now,
                    replica,
                    Reason.SCORED,
                    self.name,
                    matches.get(replica.replica_id, 0),
                )
        return _no_route(request, self.state, self.name)

    def _pool(self, live: ReplicaSet, matches: dict[str, int]) -> list[ReplicaState]:
        if len(live) <= self.max_scored:
            return live.items
        pool = {
            replica.replica_id: replica
            for replica in self.state.rng.sample(live.items, self.max_scored)
        }
        member = live.get
        for replica_id in matches:
            holder = member(replica_id)
            if holder is not None:
                pool[replica_id] = holder
        return list(pool.values())

    def _best(
        self, candidates: list[ReplicaState], matches: dict[str, int], total_blocks: int
    ) -> ReplicaState:
        # Same scores as weights.queue * queue + weights.kv_cache * (1 - kv) + weights.prefix
        # * prefix, term by term, with the lookups hoisted out of the loop.
        queues = [replica.waiting for replica in candidates]
        shortest = min(queues)
        longest = max(queues)
        spread = longest - shortest
        weights = self.weights
        queue_weight, kv_weight, prefix_weight = weights.queue, weights.kv_cache, weights.prefix
        get_blocks = matches.get
        best: list[ReplicaState] = []
        best_score = -1.0
        for replica, waiting in zip(candidates, queues, strict=True):
            queue = 1.0 if spread == 0 else (longest - waiting) / spread
            prefix = get_blocks(replica.replica_id, 0) / total_blocks if total_blocks else 0.0
            score = (
                queue_weight * queue + kv_weight * (1.0 - replica.kv_usage) + prefix_weight * prefix
            )
            if score > best_score + 1e-12:
                best, best_score = [replica], score
            elif score >= best_score - 1e-12:
                best.append(replica)
        return best[0] if len(best) == 1 else self.state.rng.choice(best)


def _candidates(
    pool: list[ReplicaState], request: RouteRequest, now: float, config: RouterConfig
) -> list[ReplicaState]:
    """`is_candidate`'s filters over a pool, inline, in the pool's order."""
    dead_after_s = config.dead_after_s
    allowed = request.allowed_regions
    prompt_tokens = request.prompt_tokens
    adapter = request.adapter
    kept: list[ReplicaState] = []
    for replica in pool:
        if not replica.healthy or replica.breaker_open_until > now:
            continue
        if now - replica.telemetry_at > dead_after_s:
            continue
        if allowed is not None and replica.region not in allowed:
            continue
        if prompt_tokens > replica.perf.kv_capacity_tokens:
            continue
        if (
            adapter is not None
            and replica.max_loras <= 0
            and adapter not in replica.adapters_loaded
        ):
            continue
        kept.append(replica)
    return kept


def _can_meet_when_idle(
    perf: ReplicaPerf, request: RouteRequest, ttft_limit: float, tpot_limit: float
) -> bool:
    """Whether an idle replica of this shape could meet the SLO (prefix cache aside)."""
    if perf.decode_base_s + perf.decode_s_per_seq > tpot_limit:
        return False
    return perf.prefill_base_s + perf.prefill_s_per_token * request.prompt_tokens <= ttft_limit


# An option as a plain tuple, since a NamedTuple pays a Python-level __new__ per candidate:
# (rank_price, ttft_s, tpot_s, replica, reason, cached_blocks, meets). ttft_s and tpot_s are
# None where the prediction was deferred: the replica provably misses the TPOT objective,
# so its prediction matters only if nothing meets the SLO (see CostAware._pick).
_Option = tuple[float, float | None, float | None, ReplicaState, Reason, int, bool]
_RANK, _TTFT, _TPOT, _REPLICA, _REASON, _BLOCKS, _MEETS = range(7)


class CostAware:
    """The cheapest replica whose predicted TTFT and TPOT are within `slo_margin` of the
    request's SLO tier.

    Ranking price = price per hour x (1 - prefix_bonus x fraction of prefix held x
    TTFT headroom left on the holder - adapter_bonus if the adapter is loaded). Candidates: every replica holding the
    prefix, a few holding the adapter, and per group (cheapest first, stopping once a
    group cannot beat the best price found, and skipping groups too slow to meet the SLO
    even when idle) all members of a small group or `samples_per_group` random ones of a
    large group. Among candidates within
    `near_tie_fraction` of the cheapest, two are drawn and the lower predicted TTFT wins.
    When none meets the SLO: the least-bad one (smallest multiple of its objective),
    flagged `queue_advised` when it misses by more than `queue_over_slo_factor`; but a
    request of a looser tier than the tightest takes the cheapest replica missing by at
    most that factor, when there is one (`yield_to_tighter_tiers`).

    The hot loop computes `predict`'s TTFT and TPOT inline (same expressions in the same
    order, so the same floats) and skips the prediction of a candidate that cannot change
    the decision: one ranked above the near-tie limit of a price that already meets, or
    one whose decode step alone misses the TPOT objective once something meets. The
    decision itself carries `predict`'s own figures for the chosen replica.
    """

    name = "cost_aware"

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self.config = config or RouterConfig()
        objectives = [t.ttft_s for t in self.config.slo_tiers.values() if t.ttft_s is not None]
        self._tightest_ttft_s = min(objectives, default=None)

    def choose(self, request: RouteRequest, now: float) -> Decision:
        state = self.state
        route = state.route(request.model)
        if route is None:
            return _no_route(request, state, self.name)
        matches = (
            state.prefix_index.longest_matches(request.tenant, request.prefix_hashes)
            if request.prefix_hashes
            else {}
        )
        tier = self.config.tier(request.tier)
        for deployment in deployments_in_order(route, request):
            options, best_meeting = self._options(
                deployment.deployment_id, request, now, tier, matches
            )
            if options:
                return self._pick(options, best_meeting, request, now, tier)
        return _no_route(request, state, self.name)

    def _options(
        self,
        deployment_id: str,
        request: RouteRequest,
        now: float,
        tier: SloTier,
        matches: dict[str, int],
    ) -> tuple[list[_Option], float]:
        """Candidate options and the lowest ranking price among those meeting the SLO."""
        state, config = self.state, self.config
        options: list[_Option] = []
        append = options.append
        seen: set[str] = set()
        best_meeting = math.inf
        total_blocks = len(request.prefix_hashes)
        adapter = request.adapter
        allowed = request.allowed_regions
        prompt_tokens = request.prompt_tokens
        # Accept only predictions inside the safety margin of the objective.
        margin = config.slo_margin
        ttft_limit = math.inf if tier.ttft_s is None else tier.ttft_s * margin
        tpot_limit = math.inf if tier.tpot_s is None else tier.tpot_s * margin
        # Config and request constants of is_candidate and predict, looked up once.
        dead_after_s = config.dead_after_s
        stale_after_s = config.stale_after_s
        stale_penalty = config.stale_penalty
        block_tokens = config.prefix_block_tokens
        queued_tokens = config.assumed_queued_prompt_tokens
        adapter_load_s = config.adapter_load_s
        max_share = config.max_prefill_share
        watermark = config.kv_high_watermark
        kv_inflation = config.kv_inflation
        prefix_bonus = config.prefix_bonus
        adapter_bonus = config.adapter_bonus
        near_tie = 1.0 + config.near_tie_fraction
        uncached_tokens = prompt_tokens if prompt_tokens >= 1 else 1
        uncached_rate = uncached_tokens / PROMPT_RATE_WINDOW_S
        # The decode step bounds TPOT from below only while the prefill share is in [0, 1)
        # and the KV and staleness factors are at least 1.
        step_bounds_tpot = (
            tpot_limit != math.inf
            and max_share < 1.0
            and kv_inflation >= 0.0
            and stale_penalty >= 1.0
        )
        exp = math.exp

        def consider(replica: ReplicaState) -> bool:
            nonlocal best_meeting
            replica_id = replica.replica_id
            if replica_id in seen:
                return False
            seen.add(replica_id)
            # is_candidate, inline.
            if not replica.healthy or replica.breaker_open_until > now:
                return False
            telemetry_age = now - replica.telemetry_at
            if telemetry_age > dead_after_s:
                return False
            if allowed is not None and replica.region not in allowed:
                return False
            perf = replica.perf
            if prompt_tokens > perf.kv_capacity_tokens:
                return False
            adapters_loaded = replica.adapters_loaded
            if adapter is not None and replica.max_loras <= 0 and adapter not in adapters_loaded:
                return False

            blocks = matches.get(replica_id, 0)
            discount = 1.0
            reason = Reason.CHEAPEST_MEETING_SLO
            if adapter is not None and adapter in adapters_loaded:
                discount -= adapter_bonus
                reason = Reason.ADAPTER_AFFINITY
            if (
                not blocks
                and near_tie >= 1.0
                and best_meeting * near_tie < replica.price_per_hour * discount
            ):
                return True  # ranks above the near-tie limit whatever it predicts

            # predict, inline: keep it in step with predict.py (tests compare the two).
            inflight = replica.inflight
            waiting = replica.waiting
            load = replica.running + waiting
            if inflight > load:
                load = inflight
            batch = load if load < perf.max_num_seqs else perf.max_num_seqs
            decode_step = perf.decode_base_s + perf.decode_s_per_seq * (batch + 1)
            if (
                decode_step > tpot_limit
                and step_bounds_tpot
                and perf.prefill_s_per_token >= 0.0
                and replica.prompt_rate >= 0.0
            ):
                # Misses TPOT whatever else it predicts: needed only if nothing meets.
                if best_meeting == math.inf:
                    append((math.inf, None, None, replica, reason, blocks, False))
                return True
            if blocks:
                new_tokens = prompt_tokens - blocks * block_tokens
                if new_tokens < 1:
                    new_tokens = 1
                new_rate = new_tokens / PROMPT_RATE_WINDOW_S
            else:
                new_tokens, new_rate = uncached_tokens, uncached_rate
            per_token = perf.prefill_s_per_token
            ahead = replica.prefill_pending_tokens
            if waiting > inflight:
                ahead += (waiting - inflight) * queued_tokens
            to_prefill = ahead + new_tokens
            steps = 1 + to_prefill // perf.max_num_batched_tokens
            ttft = steps * perf.prefill_base_s + per_token * to_prefill
            if batch:
                ttft += perf.decode_base_s + perf.decode_s_per_seq * batch
            if adapter is not None and adapter not in adapters_loaded:
                ttft += adapter_load_s
            rate = replica.prompt_rate
            if rate:
                elapsed = now - replica.prompt_rate_at
                if not elapsed <= 0.0:
                    rate = rate * exp(-elapsed / PROMPT_RATE_WINDOW_S)
            share = per_token * (rate + new_rate)
            if share > max_share:
                share = max_share
            tpot = decode_step / (1.0 - share)
            factor = 1.0
            kv_usage = replica.kv_usage
            if kv_usage > watermark:
                over = (kv_usage - watermark) / (1.0 - watermark)
                factor += kv_inflation * min(over, 1.0)
            if telemetry_age > stale_after_s:
                factor *= stale_penalty
            ttft *= factor
            tpot *= factor

            if blocks:
                # Worth less the closer the holder already is to the objective.
                headroom = 1.0 - ttft / ttft_limit
                if headroom > 0.0:
                    discount -= prefix_bonus * headroom * blocks / total_blocks
                reason = Reason.PREFIX_AFFINITY
            rank_price = replica.price_per_hour * discount
            meets = ttft <= ttft_limit and tpot <= tpot_limit
            if meets and rank_price < best_meeting:
                best_meeting = rank_price
            append((rank_price, ttft, tpot, replica, reason, blocks, meets))
            return True

        for replica_id in matches:
            holder = state.replica(replica_id)
            if holder is not None and holder.deployment_id == deployment_id:
                consider(holder)
        if adapter is not None:
            holders = state.with_adapter(deployment_id, adapter)
            if holders:
                self._draw(holders.items, consider)

        # A group member without the prefix ranks at least this fraction of its price.
        floor = 1.0 - (adapter_bonus if adapter is not None else 0.0)
        hopeless: list[ReplicaGroup] = []
        for group in state.groups(deployment_id):
            if best_meeting * near_tie < group.price_per_hour * floor:
                break  # groups are sorted by price: no later one can win or tie
            if allowed is not None and group.region not in allowed:
                continue
            if not _can_meet_when_idle(group.perf, request, ttft_limit, tpot_limit):
                hopeless.append(group)
                continue
            self._draw(group.live.items, consider)
        if best_meeting == math.inf:
            # Nothing meets: the least bad may still be on hardware too slow even when idle.
            for group in hopeless:
                self._draw(group.live.items, consider)
        return options, best_meeting

    def _draw(self, members: list[ReplicaState], consider: _Consider) -> None:
        if len(members) <= self.config.full_scan_max:
            for replica in members:
                consider(replica)
            return
        # Draws that hit an excluded replica (breaker open, stale) are retried a few times.
        # int(random() * n) rather than randrange(n): a third of the cost, and the bias for
        # n far below 2**53 is nil.
        random = self.state.rng.random
        wanted = self.config.samples_per_group
        size = len(members)
        for _ in range(4 * wanted):
            if consider(members[int(random() * size)]):
                wanted -= 1
                if not wanted:
                    return

    def _pick(
        self,
        options: list[_Option],
        best_meeting: float,
        request: RouteRequest,
        now: float,
        tier: SloTier,
    ) -> Decision:
        if best_meeting != math.inf:
            limit = best_meeting * (1.0 + self.config.near_tie_fraction)
            ties = [option for option in options if option[_MEETS] and option[_RANK] <= limit]
            chosen = ties[0]
            if len(ties) > 1:
                # Power of two choices; randrange twice is a fraction of rng.sample's cost.
                randrange = self.state.rng.randrange
                first = randrange(len(ties))
                second = (first + 1 + randrange(len(ties) - 1)) % len(ties)
                a, b = ties[first], ties[second]
                chosen = a if a[_TTFT] <= b[_TTFT] else b  # type: ignore[operator]
            return self._decision(chosen, chosen[_REASON], request, now, queue_advised=False)
        # A deferred option's rank is a placeholder (infinity): rank it by its price.
        scored = [
            (
                self._violation(option, request, now, tier),
                option[_RANK] if option[_TTFT] is not None else option[_REPLICA].price_per_hour,
                option,
            )
            for option in options
        ]
        tolerable = self.config.queue_over_slo_factor
        if self._yields(tier):
            # Overloaded: a looser tier settles for the cheapest replica it can tolerate,
            # leaving the fast ones to the tighter tiers.
            within = [triple for triple in scored if triple[0] <= tolerable]
            if within:
                _, _, chosen = min(within, key=lambda triple: (triple[1], triple[0]))
                return self._decision(chosen, Reason.LEAST_BAD, request, now, queue_advised=False)
        # The smallest miss; between equal misses, the cheaper replica.
        violation, _, chosen = min(scored, key=lambda triple: (triple[0], triple[1]))
        return self._decision(
            chosen,
            Reason.LEAST_BAD,
            request,
            now,
            queue_advised=violation > tolerable,
        )

    def _yields(self, tier: SloTier) -> bool:
        """Whether a request of this tier gives way to tighter tiers when nothing meets."""
        if not self.config.yield_to_tighter_tiers or self._tightest_ttft_s is None:
            return False
        return tier.ttft_s is None or tier.ttft_s > self._tightest_ttft_s

    def _violation(
        self, option: _Option, request: RouteRequest, now: float, tier: SloTier
    ) -> float:
        ttft, tpot = option[_TTFT], option[_TPOT]
        if ttft is None or tpot is None:  # deferred: it misses, but by how much?
            prediction = predict(option[_REPLICA], request, now, self.config, option[_BLOCKS])
            ttft, tpot = prediction.ttft_s, prediction.tpot_s
        return _slo_violation(ttft, tpot, tier)

    def _decision(
        self,
        option: _Option,
        reason: Reason,
        request: RouteRequest,
        now: float,
        *,
        queue_advised: bool,
    ) -> Decision:
        replica, blocks = option[_REPLICA], option[_BLOCKS]
        if request.prefix_hashes:
            self.state.prefix_index.record(
                request.tenant, request.prefix_hashes, replica.replica_id
            )
        # The hot loop's inline figures equal predict's; the cost it never computed.
        prediction = predict(replica, request, now, self.config, blocks)
        return Decision(
            replica,
            reason,
            self.name,
            deployment_id=replica.deployment_id,
            predicted_ttft_s=prediction.ttft_s,
            predicted_tpot_s=prediction.tpot_s,
            predicted_cost_usd=prediction.cost_usd,
            cached_tokens=blocks * self.config.prefix_block_tokens,
            meets_slo=option[_MEETS],
            queue_advised=queue_advised,
        )


class _Consider(Protocol):
    def __call__(self, replica: ReplicaState) -> bool: ...


POLICIES: dict[str, type[RoundRobin | LeastLoad | WeightedScorer | CostAware]] = {
    policy.name: policy for policy in (RoundRobin, LeastLoad, WeightedScorer, CostAware)
}
