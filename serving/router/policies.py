"""Routing policies behind one interface: `choose(request, now) -> Decision`.

Every policy applies the same hard filters (health, breaker, telemetry age, allowed
regions, adapter support, prompt fits in KV), picks the deployment by canary weight first,
falls back to the other weighted deployments when the chosen one has no candidate, and
records the request's prefix against the chosen replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from serving.router.canary import deployments_in_order
from serving.router.contracts import (
    Decision,
    Reason,
    ReplicaPerf,
    ReplicaState,
    RouterConfig,
    RouteRequest,
    SloTier,
)
from serving.router.index import ReplicaGroup, ReplicaSet, RouterState
from serving.router.predict import Prediction, is_candidate, predict


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, now: float) -> Decision: ...


def _meets(prediction: Prediction, tier: SloTier) -> bool:
    return (tier.ttft_s is None or prediction.ttft_s <= tier.ttft_s) and (
        tier.tpot_s is None or prediction.tpot_s <= tier.tpot_s
    )


def _slo_violation(prediction: Prediction, tier: SloTier) -> float:
    """How many times over its objective the prediction is (<= 1 means it meets it)."""
    ratio = 0.0
    if tier.ttft_s is not None:
        ratio = prediction.ttft_s / tier.ttft_s
    if tier.tpot_s is not None:
        ratio = max(ratio, prediction.tpot_s / tier.tpot_s)
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
    """Fewest requests queued, running and in flight from here; a full scan."""

    name = "least_load"

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self.config = config or RouterConfig()

    def choose(self, request: RouteRequest, now: float) -> Decision:
        route = self.state.route(request.model)
        if route is None:
            return _no_route(request, self.state, self.name)
        for deployment in deployments_in_order(route, request):
            best: ReplicaState | None = None
            best_load = 0
            live = self.state.live(deployment.deployment_id).items
            # A random starting point so equal loads do not all land on the first replica.
            start = self.state.rng.randrange(len(live)) if live else 0
            for step in range(len(live)):
                replica = live[(start + step) % len(live)]
                load = replica.waiting + replica.running + replica.inflight
                if (best is None or load < best_load) and is_candidate(
                    replica, request, now, self.config
                ):
                    best, best_load = replica, load
            if best is not None:
                return _decide(
                    self.state, self.config, request, now, best, Reason.LEAST_LOAD, self.name
                )
        return _no_route(request, self.state, self.name)


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
            candidates = [
                replica
                for replica in self._pool(live, matches)
                if is_candidate(replica, request, now, self.config)
            ]
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
        for replica_id in matches:
            if replica_id in live:
                holder = self.state.replica(replica_id)
                if holder is not None:
                    pool[replica_id] = holder
        return list(pool.values())

    def _best(
        self, candidates: list[ReplicaState], matches: dict[str, int], total_blocks: int
    ) -> ReplicaState:
        shortest = min(replica.waiting for replica in candidates)
        longest = max(replica.waiting for replica in candidates)
        spread = longest - shortest
        weights = self.weights
        best: list[ReplicaState] = []
        best_score = -1.0
        for replica in candidates:
            queue = 1.0 if spread == 0 else (longest - replica.waiting) / spread
            prefix = matches.get(replica.replica_id, 0) / total_blocks if total_blocks else 0.0
            score = (
                weights.queue * queue
                + weights.kv_cache * (1.0 - replica.kv_usage)
                + weights.prefix * prefix
            )
            if score > best_score + 1e-12:
                best, best_score = [replica], score
            elif score >= best_score - 1e-12:
                best.append(replica)
        return best[0] if len(best) == 1 else self.state.rng.choice(best)


def _can_meet_when_idle(
    perf: ReplicaPerf, request: RouteRequest, ttft_limit: float, tpot_limit: float
) -> bool:
    """Whether an idle replica of this shape could meet the SLO (prefix cache aside)."""
    if perf.decode_base_s + perf.decode_s_per_seq > tpot_limit:
        return False
    return perf.prefill_base_s + perf.prefill_s_per_token * request.prompt_tokens <= ttft_limit


class _Option(NamedTuple):
    rank_price: float
    prediction: Prediction
    replica: ReplicaState
    reason: Reason
    cached_blocks: int
    meets: bool


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
    flagged `queue_advised` when it misses by more than `queue_over_slo_factor`.
    """

    name = "cost_aware"

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self.config = config or RouterConfig()

    def choose(self, request: RouteRequest, now: float) -> Decision:
        route = self.state.route(request.model)
        if route is None:
            return _no_route(request, self.state, self.name)
        matches = (
            self.state.prefix_index.longest_matches(request.tenant, request.prefix_hashes)
            if request.prefix_hashes
            else {}
        )
        tier = self.config.tier(request.tier)
        for deployment in deployments_in_order(route, request):
            options, best_meeting = self._options(
                deployment.deployment_id, request, now, tier, matches
            )
            if options:
                return self._pick(options, best_meeting, request, tier)
        return _no_route(request, self.state, self.name)

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
        seen: set[str] = set()
        best_meeting = math.inf
        total_blocks = len(request.prefix_hashes)
        adapter = request.adapter
        # Accept only predictions inside the safety margin of the objective.
        margin = config.slo_margin
        ttft_limit = math.inf if tier.ttft_s is None else tier.ttft_s * margin
        tpot_limit = math.inf if tier.tpot_s is None else tier.tpot_s * margin

        def consider(replica: ReplicaState) -> bool:
            nonlocal best_meeting
            if replica.replica_id in seen:
                return False
            seen.add(replica.replica_id)
            if not is_candidate(replica, request, now, config):
                return False
            blocks = matches.get(replica.replica_id, 0)
            prediction = predict(replica, request, now, config, blocks)
            discount = 1.0
            reason = Reason.CHEAPEST_MEETING_SLO
            if adapter is not None and adapter in replica.adapters_loaded:
                discount -= config.adapter_bonus
                reason = Reason.ADAPTER_AFFINITY
            if blocks:
                # Worth less the closer the holder already is to the objective.
                headroom = 1.0 - prediction.ttft_s / ttft_limit
                if headroom > 0.0:
                    discount -= config.prefix_bonus * headroom * blocks / total_blocks
                reason = Reason.PREFIX_AFFINITY
            rank_price = replica.price_per_hour * discount
            meets = prediction.ttft_s <= ttft_limit and prediction.tpot_s <= tpot_limit
            if meets and rank_price < best_meeting:
                best_meeting = rank_price
            options.append(_Option(rank_price, prediction, replica, reason, blocks, meets))
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
        floor = 1.0 - (config.adapter_bonus if adapter is not None else 0.0)
        allowed = request.allowed_regions
        hopeless: list[ReplicaGroup] = []
        for group in state.groups(deployment_id):
            if best_meeting * (1.0 + config.near_tie_fraction) < group.price_per_hour * floor:
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
        self, options: list[_Option], best_meeting: float, request: RouteRequest, tier: SloTier
    ) -> Decision:
        if best_meeting != math.inf:
            limit = best_meeting * (1.0 + self.config.near_tie_fraction)
            ties = [option for option in options if option.meets and option.rank_price <= limit]
            chosen = ties[0]
            if len(ties) > 1:
                # Power of two choices; randrange twice is a fraction of rng.sample's cost.
                randrange = self.state.rng.randrange
                first = randrange(len(ties))
                second = (first + 1 + randrange(len(ties) - 1)) % len(ties)
                a, b = ties[first], ties[second]
                chosen = a if a.prediction.ttft_s <= b.prediction.ttft_s else b
            return self._decision(chosen, chosen.reason, request, queue_advised=False)
        violation, chosen = min(
            ((_slo_violation(option.prediction, tier), option) for option in options),
            key=lambda pair: pair[0],
        )
        return self._decision(
            chosen,
            Reason.LEAST_BAD,
            request,
            queue_advised=violation > self.config.queue_over_slo_factor,
        )

    def _decision(
        self, option: _Option, reason: Reason, request: RouteRequest, *, queue_advised: bool
    ) -> Decision:
        replica = option.replica
        if request.prefix_hashes:
            self.state.prefix_index.record(
                request.tenant, request.prefix_hashes, replica.replica_id
            )
        return Decision(
            replica,
            reason,
            self.name,
            deployment_id=replica.deployment_id,
            predicted_ttft_s=option.prediction.ttft_s,
            predicted_tpot_s=option.prediction.tpot_s,
            predicted_cost_usd=option.prediction.cost_usd,
            cached_tokens=option.cached_blocks * self.config.prefix_block_tokens,
            meets_slo=option.meets,
            queue_advised=queue_advised,
        )


class _Consider(Protocol):
    def __call__(self, replica: ReplicaState) -> bool: ...


POLICIES: dict[str, type[RoundRobin | LeastLoad | WeightedScorer | CostAware]] = {
    policy.name: policy for policy in (RoundRobin, LeastLoad, WeightedScorer, CostAware)
}
