"""Routing policies behind one interface: `choose(request, now) -> Decision`.

Every policy applies the same hard filters (health, breaker, telemetry age, allowed
regions, adapter support, prompt fits in KV), picks the version by canary weight first
(`canary.versions_in_order`), falls back to the other weighted versions when the chosen one
has no candidate, and records the request's prefix against the chosen replica. Inside a
version the policy chooses among the replicas of all its deployments, one per pool: the
cheapest meeting the SLO, the lightest, the next in turn or the best scored across all of
them. `RouterState` indexes replicas by deployment; the policies combine a version's
deployments per request, and the common case, one deployment per version, takes the
index as it is. Every decision also names the replica least load would have picked
instead (`least_load_pick`), the baseline that the router's saving is measured against.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from typing import ClassVar, Final, Protocol

from serving.router.canary import versions_in_order
from serving.router.contracts import (
    Decision,
    DeploymentRoute,
    Reason,
    ReplicaPerf,
    ReplicaState,
    RouterConfig,
    RouteRequest,
    SloTier,
    VersionRoute,
    pickle_by_constructor,
)
from serving.router.index import LoadBuckets, ReplicaGroup, RouterState, queue_load
from serving.router.predict import (
    Prediction,
    RequestPredictor,
    idle_prefill_s,
    is_candidate,
    predict,
)
from serving.router.prefix import PrefixIndex


class Policy(Protocol):
    state: RouterState

    @property
    def name(self) -> str: ...  # a class constant in each policy

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


def _tpot_objective(tier: SloTier) -> float:
    """The tier's TPOT objective; infinity for a tier without one."""
    return tier.tpot_s if tier.tpot_s is not None else math.inf


def _tighter_in_flight(replica: ReplicaState, tpot_s: float) -> int:
    """The requests in flight on the replica (this gateway's count) whose TPOT objective is
    tighter than `tpot_s`."""
    count = 0
    for objective, requests in replica.inflight_tpot_objectives.items():
        if objective < tpot_s:
            count += requests
    return count


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
    *,
    baseline: ReplicaState | None,
) -> Decision:
    """The decision to send the request to `replica`; `baseline` is least load's pick."""
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
        baseline_replica=baseline,
        ttft_scale=replica.ttft_scale,
    )


def _lightest(
    by_load: LoadBuckets,
    request: RouteRequest,
    now: float,
    config: RouterConfig,
    random: Callable[[], float] | None = None,
) -> ReplicaState | None:
    """A candidate of the lightest load bucket holding one, walking buckets from the
    lightest and checking `is_candidate` per replica as it is visited.

    Ties: each bucket's members are visited in cyclic order from `int(random() * size)`
    (one draw per bucket visited), or from its first member when `random` is None, which
    is deterministic and draws nothing.
    """
    buckets = by_load.buckets
    for load in by_load.loads:
        members = buckets[load].items
        size = len(members)
        start = int(random() * size) if random is not None else 0
        for position in range(start, start + size):
            replica = members[position % size]
            if is_candidate(replica, request, now, config):
                return replica
    return None


def _at(lists: list[list[ReplicaState]], index: int) -> ReplicaState:
    """Item `index` of the lists' concatenation, without building it."""
    for items in lists:
        if index < len(items):
            return items[index]
        index -= len(items)
    raise IndexError(index)


def _lightest_across(
    by_loads: list[LoadBuckets],
    request: RouteRequest,
    now: float,
    config: RouterConfig,
    random: Callable[[], float] | None = None,
) -> ReplicaState | None:
    """`_lightest` over several deployments' buckets as if they were one: loads ascending
    across all of them, the members of one load across them one bucket (the deployments'
    members in turn), the same draw per bucket visited."""
    previous = -1
    for load in heapq.merge(*(by_load.loads for by_load in by_loads)):
        if load == previous:
            continue
        previous = load
        members = [b.buckets[load].items for b in by_loads if load in b.buckets]
        size = sum(len(items) for items in members)
        start = int(random() * size) if random is not None else 0
        for position in range(start, start + size):
            replica = _at(members, position % size)
            if is_candidate(replica, request, now, config):
                return replica
    return None


def _lightest_in(
    state: RouterState,
    version: VersionRoute,
    request: RouteRequest,
    now: float,
    config: RouterConfig,
    random: Callable[[], float] | None = None,
) -> ReplicaState | None:
    """The lightest candidate across the version's deployments (see `_lightest`)."""
    deployments = version.deployments
    if len(deployments) == 1:
        return _lightest(state.by_load(deployments[0].deployment_id), request, now, config, random)
    if random is None:
        # Each deployment's own first lightest candidate, then the lightest of those (the
        # earlier deployment on a tie): what the merged walk finds from each bucket's first
        # member, without merging the loads. The baseline of every decision comes this way.
        best: ReplicaState | None = None
        best_load = 0
        for deployment in deployments:
            replica = _lightest(state.by_load(deployment.deployment_id), request, now, config)
            if replica is not None and (best is None or queue_load(replica) < best_load):
                best, best_load = replica, queue_load(replica)
        return best
    by_loads = [state.by_load(deployment.deployment_id) for deployment in deployments]
    return _lightest_across(by_loads, request, now, config, random)


def least_load_pick(
    state: RouterState,
    config: RouterConfig,
    request: RouteRequest,
    now: float,
    *,
    split: VersionRoute | None = None,
) -> ReplicaState | None:
    """The replica least load would pick for the request now: the same version order,
    deployments and hard filters as every policy, the same bucket walk as `LeastLoad`.

    For the baseline of another policy's decision, so it changes nothing that policy does:
    it draws nothing from `state.rng` (a tie goes to the first candidate of the lightest
    bucket holding one, where `LeastLoad` itself starts from a random member) and records
    no prefix.

    `split`: the version the canary split chose for the request (the first of
    `versions_in_order`), when the caller found a candidate there. Least load's pick is
    then in it, since every candidate is in its deployment's load buckets, and the walk
    starts there without hashing the request again (most of this function's cost).
    """
    if split is not None:
        return _lightest_in(state, split, request, now, config)
    route = state.route(request.model)
    if route is None:
        return None
    for version in versions_in_order(route, request):
        best = _lightest_in(state, version, request, now, config)
        if best is not None:
            return best
    return None


class RoundRobin:
    name: ClassVar[str] = "round_robin"

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self.config = config or RouterConfig()
        # The next turn per version, keyed by its first deployment (a deployment is of one
        # version): the turn goes round all the version's deployments.
        self._next: dict[str, int] = {}

    def choose(self, request: RouteRequest, now: float) -> Decision:
        route = self.state.route(request.model)
        if route is None:
            return _no_route(request, self.state, self.name)
        for position, version in enumerate(versions_in_order(route, request)):
            deployments = version.deployments
            turn = deployments[0].deployment_id
            live = self.state.live(turn).items if len(deployments) == 1 else self._live(deployments)
            start = self._next.get(turn)
            if start is None:
                # A new turn (this gateway's first request, or a new routing-table version)
                # starts where this state's seed says, not at the first replica: gateways
                # that all started at replica 0 on every table version would send it a burst.
                start = self.state.rng.randrange(len(live)) if live else 0
            for step in range(len(live)):
                replica = live[(start + step) % len(live)]
                if is_candidate(replica, request, now, self.config):
                    self._next[turn] = start + step + 1
                    split = version if position == 0 else None
                    return _decide(
                        self.state,
                        self.config,
                        request,
                        now,
                        replica,
                        Reason.ROUND_ROBIN,
                        self.name,
                        baseline=least_load_pick(
                            self.state, self.config, request, now, split=split
                        ),
                    )
        return _no_route(request, self.state, self.name)

    def _live(self, deployments: tuple[DeploymentRoute, ...]) -> list[ReplicaState]:
        # A copy per request, only for a version on several pools: round robin is a
        # baseline to compare with, not the policy a large fleet runs.
        return [r for d in deployments for r in self.state.live(d.deployment_id).items]


class LeastLoad:
    """Fewest requests queued, running and in flight from here (`queue_load`).

    Exact without a scan: `RouterState.by_load` keeps each deployment's live replicas in
    buckets by load, so the search walks buckets from the lightest (across the version's
    deployments) and stops at the first one holding a candidate. The time-dependent
    filters (breaker, telemetry age) and the request's own (regions, adapter, prompt size)
    are checked per replica as it is visited, so a replica they exclude is skipped and the
    walk goes on: the answer is the scan's, and only a request that excludes most light
    replicas pays for a long walk.
    Ties: a random member of the lightest bucket holding a candidate (the bucket's
    candidates in cyclic order from a random start, the first taken). Its decision's
    baseline is its own pick.
    """

    name: ClassVar[str] = "least_load"

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self.config = config or RouterConfig()

    def choose(self, request: RouteRequest, now: float) -> Decision:
        route = self.state.route(request.model)
        if route is None:
            return _no_route(request, self.state, self.name)
        # A random starting point in each bucket so equal loads do not all land on one replica.
        random = self.state.rng.random
        for version in versions_in_order(route, request):
            best = _lightest_in(self.state, version, request, now, self.config, random)
            if best is not None:
                return _decide(
                    self.state,
                    self.config,
                    request,
                    now,
                    best,
                    Reason.LEAST_LOAD,
                    self.name,
                    baseline=best,
                )
        return _no_route(request, self.state, self.name)


@dataclass(slots=True, frozen=True)
class ScorerWeights:
    """llm-d's default endpoint-picker profile."""

    queue: float = 2.0
    kv_cache: float = 2.0
    prefix: float = 3.0


pickle_by_constructor(ScorerWeights)


class WeightedScorer:
    """Queue + KV-cache utilisation + prefix scorers, weighted, highest total wins.

    Normalised as llm-d's scorers do: queue is min-max over the candidates' waiting
    queues (shortest 1, longest 0, all equal 1); KV is 1 - kv_usage; prefix is the
    fraction of the request's blocks the replica holds as a leading run. Ties are broken
    at random. Above `max_scored` candidates we score a random sample plus every prefix
    holder, since min-max over thousands of replicas per request costs milliseconds.

    Not llm-d as it ships: this reads the shared `RouterState.prefix_index` and whatever
    telemetry the caller last scraped, and samples large fleets. The faithful model of
    llm-d's endpoint picker (its own per-endpoint prefix LRU, model-name block, 50 ms
    metrics refresh, cited to source) is `serving.router.peers.llm_d.LlmDEpp`; compare
    against that one.
    """

    name: ClassVar[str] = "weighted_scorer"

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
        for position, version in enumerate(versions_in_order(route, request)):
            candidates = _candidates(self._pool(version, matches), request, now, self.config)
            if candidates:
                replica = self._best(candidates, matches, len(request.prefix_hashes))
                split = version if position == 0 else None
                return _decide(
                    self.state,
                    self.config,
                    request,
                    now,
                    replica,
                    Reason.SCORED,
                    self.name,
                    matches.get(replica.replica_id, 0),
                    baseline=least_load_pick(self.state, self.config, request, now, split=split),
                )
        return _no_route(request, self.state, self.name)

    def _pool(self, version: VersionRoute, matches: dict[str, int]) -> list[ReplicaState]:
        """The live replicas of the version's deployments, or a sample of them plus every
        prefix holder among them."""
        deployments = version.deployments
        if len(deployments) == 1:
            live = self.state.live(deployments[0].deployment_id)
            if len(live) <= self.max_scored:
                return live.items
            lives = [live]
            sample = self.state.rng.sample(live.items, self.max_scored)
        else:
            lives = [self.state.live(deployment.deployment_id) for deployment in deployments]
            items = [live.items for live in lives]
            total = sum(len(members) for members in items)
            if total <= self.max_scored:
                return [replica for members in items for replica in members]
            # The same draw as sampling the concatenation, without building it.
            positions = self.state.rng.sample(range(total), self.max_scored)
            sample = [_at(items, position) for position in positions]
        pool = {replica.replica_id: replica for replica in sample}
        for live in lives:
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
    return idle_prefill_s(perf, request.prompt_tokens) <= ttft_limit


# An option as a plain tuple, since a NamedTuple pays a Python-level __new__ per candidate:
# (rank_price, ttft_s, tpot_s, replica, reason, cached_blocks, meets, longest_blocks).
# ttft_s and tpot_s are None where the prediction was deferred: the replica provably misses
# the TPOT objective, so its prediction matters only if nothing meets the SLO (see
# CostAware._pick). cached_blocks is the replica's own run of the prompt's prefix, which its
# prediction and the decision's cached tokens count; longest_blocks the same where the
# replica is among the holders of the longest run (`PrefixIndex.longest_matches`), else 0:
# only those draw the request by affinity (`_Candidates.consider`).
_Option = tuple[float, float | None, float | None, ReplicaState, Reason, int, bool, int]
_RANK: Final = 0
_TTFT: Final = 1
_TPOT: Final = 2
_REPLICA: Final = 3
_REASON: Final = 4
_BLOCKS: Final = 5
_MEETS: Final = 6
_LONGEST: Final = 7


class CostAware:
    """The cheapest replica whose predicted TTFT and TPOT are within their margins of the
    request's SLO tier (`ttft_margin`, `tpot_margin`).

    Ranking price = price per hour x (1 - prefix_bonus x fraction of prefix held x headroom
    left on the holder, on the tighter of TTFT and TPOT, `prefix_bonus_floor` past them -
    adapter_bonus if the adapter is loaded). Candidates: every replica holding the prefix,
    a few holding the adapter, and per group (cheapest first, stopping once a group cannot
    beat the best price found, and skipping groups too slow to meet the SLO even when idle)
    all members of a small group or `samples_per_group` random ones of a large group, and
    as many again, up to `redraws_when_unsettled` times, while those hold none to settle
    on (`_settled`). Among candidates within `near_tie_fraction` of the cheapest, two are
    drawn and the one using less of its objective on the clock that binds (TTFT or TPOT)
    wins.

    A candidate's prediction counts the run of the prompt's prefix its own record holds
    (`PrefixIndex.run_on`), and the decision's cached tokens the same, as its engine will
    hit them; the prefix discount and the draw's preference go only to the holders of the
    longest run (`PrefixIndex.longest_matches`). Counting only those holders, the router
    credited a replica holding a tenant's repository but not the session's file with
    nothing: on code over 16 L40S, 3,936 of 11,317 requests landed on a replica whose
    engine hit their prefix (12.1 M tokens) while the router had counted none, its
    expected hits 26.1 M against the engines' 38.1 M; now they agree. Drawn to every
    holder of a shorter run as well, a cold start piled a popular repository's traffic on
    the replicas it first landed on (code over 6 RTX PRO 6000, seed 0: 98.85 % of
    interactive requests within both clocks against 99.26 % before; 99.13 % this way).

    Every sequence on a replica decodes in the same steps, so a request's predicted TPOT
    there is what it brings every sequence there to. The router knows the TPOT objectives
    of its own requests in flight on each replica (`ReplicaState.tightest_tpot_s`); a
    candidate whose predicted TPOT passes the tightest of them (times `tpot_margin`) is
    harmful. The draw is among the harmless near ties when there are any, and of them
    among those holding the longest run of the prompt's prefix blocks, when any holds
    some: a replica meeting the SLO harmlessly with the prompt cached beats one that
    would compute it again, whatever their loads (the ranking price's prefix discount
    shrinks with the holder's headroom, so a busy holder tied with idle replicas and the
    draw sent conversations away from their KV: chat over 4 H100, 98.96 % of interactive
    requests within both clocks before, 100.00 % after; code over 6 RTX PRO 6000, 95.19 %
    and 99.39 %). A request of a looser tier draws among those on replicas where no
    tighter tier than its own decodes, when there are some, so looser work gathers and the
    replicas carrying the tightest tier keep their steps short (chat over 22 L40S: 58.45 %
    of interactive requests within both clocks drawing among all harmless near ties,
    92.87 % gathering). Where it meets only on replicas carrying a tighter tier, and on a
    cheaper replica it would still meet its objectives outside the margin, it takes the
    path below instead, leaving the dearer replicas to the tighter tier
    (`_cheaper_meeting`). When all are harmful, a request of the tightest tier draws
    among them anyway, and one of a looser tier takes the path below, as if nothing met:
    a batch request decoding at leisure must not push the chat requests beside it past
    50 ms a token, nor take a replica they need just because it alone is fast enough to
    carry it harmlessly. Nor may it wait without end: a tier without a TTFT objective is
    routed with `untimed_ttft_s` as one (`RouterConfig.tier`), so batch work does not pile
    onto the one replica it harms no one on.

    When none meets the SLO: the least-bad one (smallest multiple of its objective), flagged
    `queue_advised` when it misses by more than `queue_over_slo_factor`; but a request of a
    looser tier than the tightest (`yield_to_tighter_tiers`) takes the cheapest replica
    missing by at most that factor, and one predicted to miss its objective on every
    candidate (`yield_when_lost`) the cheapest, by however much it misses there: a request
    lost to the SLO wherever it goes should not take the fast replicas from requests that
    can still meet it. Between ranking prices within `near_tie_fraction` of the cheapest the
    least harmful wins there (a holder predicted to miss keeps `prefix_bonus_floor` of its
    prefix discount, so one holding much of the prompt ranks past the near tie), and the
    least-bad one is judged on its harm as well as its own miss. A looser tier's request
    first takes, of those where it meets its own objectives within the margin and would
    start within the margin of the tightest TTFT objective, the one carrying the fewest
    requests of tighter tiers (`_gather`): looser work gathers on a few replicas and fills
    their decode batches, and the rest keep the tightest tier's steps short (chat over 2
    H100 + 7 L40S: 84.10 % of interactive requests within both clocks choosing by harm
    alone, 92.83 % gathering). Before that near tie, a looser tier keeps to the candidates
    where it would still meet its own objectives, margin or not, when there are any: a
    holder of its prefix where it would miss no longer wins on its discount's floor
    (bursty over 17 L40S, seed 0: standard requests within both clocks 92.68 % before,
    100.00 % after).

    The hot loop (`_Candidates.consider`) predicts with `predict`'s own steps
    (`RequestPredictor`, so the same floats) and skips the prediction of a candidate that
    cannot change the decision: one ranked above the near-tie limit of a price that already
    meets, or one whose decode step alone misses the TPOT objective once something meets.
    The decision itself carries `predict`'s figures for the chosen replica.
    """

    name: ClassVar[str] = "cost_aware"

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self.config = config or RouterConfig()
        objectives = [t.ttft_s for t in self.config.slo_tiers.values() if t.ttft_s is not None]
        self._tightest_ttft_s = min(objectives, default=None)
        # The groups of each version on several deployments, merged cheapest first, keyed
        # by the version's first deployment; for `_merged_for`, the state they came from.
        self._merged_groups: dict[str, list[ReplicaGroup]] = {}
        self._merged_for = state

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
        for position, version in enumerate(versions_in_order(route, request)):
            candidates = self._options(version, request, now, tier, matches)
            if candidates.options:
                split = version if position == 0 else None
                baseline = least_load_pick(state, self.config, request, now, split=split)
                decision = self._pick(candidates, request, tier, baseline)
                if not decision.queue_advised and self._defers(candidates, request, tier):
                    decision.queue_advised = True
                return decision
        return _no_route(request, state, self.name)

    def _options(
        self,
        version: VersionRoute,
        request: RouteRequest,
        now: float,
        tier: SloTier,
        matches: dict[str, int],
    ) -> _Candidates:
        """The candidate options across the version's deployments, and the lowest ranking
        price among those meeting the SLO."""
        candidates = _Candidates(request, now, self.config, tier, matches, self.state.prefix_index)
        self._consider_holders(version, request, matches, candidates)
        groups = self._groups(version)
        self._consider_groups(groups, request, candidates)
        for _ in range(self.config.redraws_when_unsettled):
            if self._settled(candidates, tier):
                break
            # Drawn replicas are not drawn again (`_Candidates.seen`), so small groups,
            # scanned in full, add nothing.
            self._consider_groups(groups, request, candidates)
        return candidates

    def _groups(self, version: VersionRoute) -> list[ReplicaGroup]:
        """The groups of the version's deployments, cheapest first."""
        deployments = version.deployments
        if len(deployments) == 1:
            return self.state.groups(deployments[0].deployment_id)
        if self._merged_for is not self.state:
            self._merged_groups, self._merged_for = {}, self.state
        key = deployments[0].deployment_id
        merged = self._merged_groups.get(key)
        if merged is None:
            # A state builds each deployment's groups once (their members change in place),
            # so the merge holds for the state's life. Stable: ties in deployment order.
            groups = (self.state.groups(deployment.deployment_id) for deployment in deployments)
            merged = self._merged_groups[key] = sorted(
                chain.from_iterable(groups), key=_group_price
            )
        return merged

    def _consider_holders(
        self,
        version: VersionRoute,
        request: RouteRequest,
        matches: dict[str, int],
        candidates: _Candidates,
    ) -> None:
        """Every replica of the version holding the prefix, and a few per deployment holding
        the adapter."""
        state = self.state
        deployment_ids = version.deployment_ids
        for replica_id in matches:
            holder = state.replica(replica_id)
            if holder is not None and holder.deployment_id in deployment_ids:
                candidates.consider(holder)
        if request.adapter is not None:
            for deployment in version.deployments:
                holders = state.with_adapter(deployment.deployment_id, request.adapter)
                if holders:
                    self._draw(holders.items, candidates.consider)

    def _consider_groups(
        self, groups: Iterable[ReplicaGroup], request: RouteRequest, candidates: _Candidates
    ) -> None:
        """Per group, cheapest first, until no group can beat or tie the best price found;
        groups too slow to meet the SLO even when idle only if nothing meets it."""
        near_tie = 1.0 + self.config.near_tie_fraction
        # A group member without the prefix ranks at least this fraction of its price.
        floor = 1.0 - (self.config.adapter_bonus if request.adapter is not None else 0.0)
        allowed = request.allowed_regions
        hopeless: list[ReplicaGroup] = []
        for group in groups:
            if candidates.best_meeting * near_tie < group.price_per_hour * floor:
                break  # groups are sorted by price: no later one can win or tie
            if allowed is not None and group.region not in allowed:
                continue
            if not _can_meet_when_idle(
                group.perf, request, candidates.ttft_limit, candidates.tpot_limit
            ):
                hopeless.append(group)
                continue
            self._draw(group.live.items, candidates.consider)
        if candidates.best_meeting == math.inf:
            # Nothing meets: the least bad may still be on hardware too slow even when idle.
            for group in hopeless:
                self._draw(group.live.items, candidates.consider)

    def _draw(self, members: list[ReplicaState], consider: Callable[[ReplicaState], bool]) -> None:
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
        candidates: _Candidates,
        request: RouteRequest,
        tier: SloTier,
        baseline: ReplicaState | None,
    ) -> Decision:
        options, best_meeting = candidates.options, candidates.best_meeting
        predictor = candidates.predictor
        looser = self._yields(tier)
        ties = self._ties(candidates, tier) if best_meeting != math.inf else []
        if ties and looser and self._cheaper_meeting(ties, candidates, tier):
            ties = []  # it leaves the tighter tiers' replicas to them: the least-bad path
        if ties:
            chosen = ties[0]
            if len(ties) > 1:
                # Power of two choices; randrange twice is a fraction of rng.sample's cost.
                randrange = self.state.rng.randrange
                first = randrange(len(ties))
                second = (first + 1 + randrange(len(ties) - 1)) % len(ties)
                a, b = ties[first], ties[second]
                chosen = a if candidates.load(a) <= candidates.load(b) else b
            return self._decision(
                chosen, chosen[_REASON], request, predictor, baseline, queue_advised=False
            )
        # (miss of its own objectives, harm, rank, option): the harm is its TPOT over the
        # tightest TPOT objective decoding there. A deferred option's rank is a placeholder
        # (infinity): predicted now, it is ranked with the same discounts as the others.
        scored = [
            (
                *self._violation(option, predictor, tier),
                option[_RANK] if option[_TTFT] is not None else candidates.deferred_rank(option),
                option,
            )
            for option in options
        ]
        tolerable = self.config.queue_over_slo_factor
        least = min(scored_option[0] for scored_option in scored)
        lost = self.config.yield_when_lost and least > 1.0
        if lost or looser:
            # Overloaded: a looser tier settles for the cheapest replica it can tolerate,
            # leaving the fast ones to the tighter tiers; and a request predicted to miss its
            # objective wherever it goes takes the cheapest, however far it misses there,
            # leaving the fast ones to requests that can still meet there. Capped at 1.5
            # times its least miss, as it was, lost requests went to the fast replicas
            # whenever the cheap ones missed by more, and the fast replicas' queue settled
            # past the objective, where no request meets (chat over 2 H100 + 7 L40S: 31.03 %
            # of interactive requests within both clocks capped, 56.84 % uncapped).
            # Between prices within the near tie of the cheapest, the least harm (so a
            # homogeneous fleet spreads them, and a prefix held a little longer on one
            # replica does not pile them there); then the cheaper. A looser tier gathers
            # first where it fits (`_gather`).
            cap = math.inf if lost else tolerable
            within = [option for option in scored if option[0] <= cap]
            if looser:
                # Where it would still meet its own objectives somewhere, a looser tier
                # goes there. A holder of its prefix predicted to miss keeps part of its
                # discount and ranked past the near tie alone, so the replicas gathering
                # looser work took every such request until their queues passed the
                # objective (bursty over 17 L40S, seed 0: 281 standard requests missed, 253
                # of them on two replicas; none now). Not "within the margin": that sends
                # it back onto a tighter tier's replica `_cheaper_meeting` had it leave.
                meeting = [option for option in within if option[0] <= 1.0]
                if meeting:
                    within = meeting
            if within:
                limit = min(option[2] for option in within) * candidates.near_tie
                near = [option for option in within if option[2] <= limit]
                if looser:
                    chosen = self._gather(near, tier)
                else:
                    chosen = min(near, key=lambda option: (max(option[0], option[1]), option[2]))[3]
                return self._decision(
                    chosen,
                    Reason.LEAST_BAD,
                    request,
                    predictor,
                    baseline,
                    queue_advised=least > tolerable,
                )
        # The smallest miss, its own or that it causes; between equal misses, the cheaper.
        own, harm, _, chosen = min(
            scored, key=lambda option: (max(option[0], option[1]), option[2])
        )
        violation = max(own, harm)
        return self._decision(
            chosen,
            Reason.LEAST_BAD,
            request,
            predictor,
            baseline,
            queue_advised=violation > tolerable,
        )

    def _settled(self, candidates: _Candidates, tier: SloTier) -> bool:
        """Whether the options drawn hold one `_ties` would settle on at its first
        choice: a harmless near tie meeting the SLO and, for a looser tier than the
        tightest, one on a replica where no tighter tier decodes."""
        if candidates.best_meeting == math.inf:
            return False
        limit = candidates.best_meeting * candidates.near_tie
        # The tightest tier settles on any replica: no objective in flight is below 0.
        own = _tpot_objective(tier) if self._yields(tier) else 0.0
        for option in candidates.options:
            if (
                option[_MEETS]
                and option[_RANK] <= limit
                and candidates.harmless(option)
                and option[_REPLICA].tightest_tpot_s >= own
            ):
                return True
        return False

    def _ties(self, candidates: _Candidates, tier: SloTier) -> list[_Option]:
        """The options to draw two from: those meeting the SLO within the near tie of the
        cheapest, and of them those keeping the sequences already decoding there within
        their objectives (harmless), of those the ones holding the longest run of the
        prompt's prefix when any holds some; for a request of a looser tier than the
        tightest, of those the ones on replicas where no tighter tier than its own decodes,
        where there are any. Where none is harmless, a request of the tightest tier takes
        its pick of them all; one of a looser tier none, so that it takes the least-bad path: the
        cheapest replica it tolerates, the least harmful of equals."""
        limit = candidates.best_meeting * candidates.near_tie
        ties = [
            option for option in candidates.options if option[_MEETS] and option[_RANK] <= limit
        ]
        harmless = [option for option in ties if candidates.harmless(option)]
        if harmless:
            # Where the prompt is held longest: computing it again elsewhere is waste.
            most = max(option[_LONGEST] for option in harmless)
            if most:
                harmless = [option for option in harmless if option[_LONGEST] == most]
            if self._yields(tier):
                # A looser tier gathers where nothing tighter than itself decodes, leaving
                # the replicas that carry the tightest tier their short steps.
                own = _tpot_objective(tier)
                apart = [o for o in harmless if o[_REPLICA].tightest_tpot_s >= own]
                if apart:
                    return apart
            return harmless
        return [] if self._yields(tier) else ties

    def _cheaper_meeting(self, ties: list[_Option], candidates: _Candidates, tier: SloTier) -> bool:
        """Whether a looser tier's request, meeting only on replicas where a tighter tier
        decodes, has a cheaper replica where it would still meet its objectives, outside the
        safety margin. Then it takes the least-bad path, which leaves the dearer replicas to
        the tighter tier: among the cheapest it tolerates, the least miss or harm (`_gather`),
        so it may still take one missing by up to `queue_over_slo_factor` there when that
        one harms the requests beside it less.

        Meeting on the dearer replicas, it had filled them: on an overloaded mixed fleet the
        standard tier's prompts took the one H100's queue while the L40Ss missed them, the
        interactive requests predicted to miss there went to the L40Ss as lost, and the
        L40Ss stayed overloaded (code over 1 H100 + 7 L40S, sixteen gateways, seed 0: the
        H100 took 154 interactive requests in ten seconds against 407 with one gateway, and
        60.16 % of interactive requests were within both clocks against 85.67 %; 84.59 %
        now). Letting it miss on the cheaper replica by up to `queue_over_slo_factor` gained
        the interactive tier more on two classes (chat over 2 H100 + 7 L40S, five seeds:
        69.39 % against 62.53) and cost the standard tier up to 42 points on three (chat
        over 2 H100 + 2 A100 + 3 L40S: 98.81 -> 57.76 % of standard requests within both
        clocks). On a homogeneous fleet no replica is cheaper, so nothing changes."""
        own_tpot = _tpot_objective(tier)
        if any(option[_REPLICA].tightest_tpot_s >= own_tpot for option in ties):
            return False
        cheapest_tie = min(option[_REPLICA].price_per_hour for option in ties)
        predictor = candidates.predictor
        return any(
            option[_REPLICA].price_per_hour < cheapest_tie
            and self._violation(option, predictor, tier)[0] <= 1.0
            for option in candidates.options
        )

    def _gather(self, near: list[tuple[float, float, float, _Option]], tier: SloTier) -> _Option:
        """A looser tier's least-bad choice among the near ties (own miss, harm, rank,
        option). Where it meets its own objectives within the margins and its prompt would
        start within the margin of the tightest tier's TTFT objective: the replica carrying
        the fewest requests of tighter tiers, so looser work gathers on a few replicas and
        fills their decode batches, and the rest keep the short steps the tightest tier
        needs. The bound on the wait keeps a gathering replica from filling its queue: a
        burst of looser prompts on one replica would miss their own TTFT. Elsewhere, and
        between equal counts, the least harm, then the cheaper."""
        wait_s = (self._tightest_ttft_s or 0.0) * self.config.ttft_margin
        own_tpot = _tpot_objective(tier)
        chosen = near[0][3]
        best: tuple[int, int, float, float] | None = None
        for own, harm, rank, option in near:
            ttft = option[_TTFT]
            # Within the margins (a deferred option, not predicted, is not).
            fits = option[_MEETS] and ttft is not None and ttft <= wait_s
            tighter = _tighter_in_flight(option[_REPLICA], own_tpot) if fits else 0
            key = (0 if fits else 1, tighter, max(own, harm), rank)
            if best is None or key < best:
                chosen, best = option, key
        return chosen

    def _defers(self, candidates: _Candidates, request: RouteRequest, tier: SloTier) -> bool:
        """Whether a looser tier's request would wait past `defer_looser_after` of the
        tightest TTFT objective before its own prefill on every candidate: the whole fleet
        (or every replica drawn) has a queue a tighter request cannot bear. Replicas that
        gather looser work queue it by design (`_gather`), and a request waiting there is no
        reason to hold it while another replica has room."""
        share = self.config.defer_looser_after
        if share is None or self._tightest_ttft_s is None or not self._yields(tier):
            return False
        limit = share * self._tightest_ttft_s
        block_tokens = self.config.prefix_block_tokens
        for option in candidates.options:
            ttft = option[_TTFT]
            if ttft is None:  # its decode misses the TPOT objective: no room there either
                continue
            uncached = max(1, request.prompt_tokens - option[_BLOCKS] * block_tokens)
            if ttft - idle_prefill_s(option[_REPLICA].perf, uncached) <= limit:
                return False
        return True

    def _yields(self, tier: SloTier) -> bool:
        """Whether a request of this tier gives way to tighter tiers when nothing meets."""
        if not self.config.yield_to_tighter_tiers or self._tightest_ttft_s is None:
            return False
        return tier.ttft_s is None or tier.ttft_s > self._tightest_ttft_s

    @staticmethod
    def _violation(
        option: _Option, predictor: RequestPredictor, tier: SloTier
    ) -> tuple[float, float]:
        """How many times over its own objectives the option is, and its harm: how many
        times over the tightest TPOT objective of the requests decoding there (both <= 1
        when within them)."""
        ttft, tpot = option[_TTFT], option[_TPOT]
        if ttft is None or tpot is None:  # deferred: it misses, but by how much?
            prediction = predictor.predict(option[_REPLICA], option[_BLOCKS])
            ttft, tpot = prediction.ttft_s, prediction.tpot_s
        return _slo_violation(ttft, tpot, tier), tpot / option[_REPLICA].tightest_tpot_s

    def _decision(
        self,
        option: _Option,
        reason: Reason,
        request: RouteRequest,
        predictor: RequestPredictor,
        baseline: ReplicaState | None,
        *,
        queue_advised: bool,
    ) -> Decision:
        replica, blocks = option[_REPLICA], option[_BLOCKS]
        if request.prefix_hashes:
            self.state.prefix_index.record(
                request.tenant, request.prefix_hashes, replica.replica_id
            )
        # The hot loop's figures are these; the cost it never computed.
        prediction = predictor.predict(replica, blocks)
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
            tpot_objective_s=self.config.tier(request.tier).tpot_s,
            queue_advised=queue_advised,
            baseline_replica=baseline,
            ttft_scale=replica.ttft_scale,
        )


def _group_price(group: ReplicaGroup) -> float:
    return group.price_per_hour


class _Candidates:
    """One version's options for one request (across its deployments), as
    `CostAware._options` collects them.

    `consider` is the hot loop: `is_candidate`'s filters, the affinity discounts, and
    `RequestPredictor`'s TTFT and TPOT, skipping the prediction of a candidate that cannot
    change the decision: one whose price ranks above the near-tie limit of a price that
    already meets, or one whose decode step alone misses the TPOT objective (deferred, kept
    only while nothing meets). `best_meeting` is the lowest ranking price meeting the SLO.
    """

    __slots__ = (
        "adapter",
        "best_meeting",
        "config",
        "first_key",
        "index",
        "matches",
        "near_tie",
        "now",
        "options",
        "predictor",
        "request",
        "seen",
        "total_blocks",
        "tpot_limit",
        "tpot_margin",
        "ttft_limit",
    )

    def __init__(
        self,
        request: RouteRequest,
        now: float,
        config: RouterConfig,
        tier: SloTier,
        matches: dict[str, int],
        index: PrefixIndex,
    ) -> None:
        self.request = request
        self.now = now
        self.config = config
        self.matches = matches
        # Where the replicas not among `matches` find their own run of the prefix, and the
        # key of its first block (`PrefixIndex.first_key`); None when no replica holds that
        # block (`matches` is then empty), so there is no run to find.
        self.index: PrefixIndex | None = None
        self.first_key = 0
        if matches:
            first_key = index.first_key(request.tenant, request.prefix_hashes)
            if first_key is not None:
                self.index, self.first_key = index, first_key
        self.predictor = RequestPredictor(request, now, config)
        self.options: list[_Option] = []
        self.seen: set[str] = set()
        self.best_meeting = math.inf
        self.adapter = request.adapter
        self.total_blocks = len(request.prefix_hashes)
        # Accept only predictions inside the safety margins of the objectives.
        self.ttft_limit, self.tpot_limit = config.limits(tier)
        self.tpot_margin = config.tpot_margin
        self.near_tie = 1.0 + config.near_tie_fraction

    def consider(self, replica: ReplicaState) -> bool:
        """Whether the replica was a candidate not seen before (its option then added,
        unless it cannot change the decision)."""
        replica_id = replica.replica_id
        if replica_id in self.seen:
            return False
        self.seen.add(replica_id)
        if not is_candidate(replica, self.request, self.now, self.config):
            return False
        blocks = longest = self.matches.get(replica_id, 0)
        adapter = self.adapter
        if adapter is not None and adapter in replica.adapters_loaded:
            discount, reason = 1.0 - self.config.adapter_bonus, Reason.ADAPTER_AFFINITY
        else:
            discount, reason = 1.0, Reason.CHEAPEST_MEETING_SLO
        near_tie = self.near_tie
        if (
            not longest
            and near_tie >= 1.0
            and self.best_meeting * near_tie < replica.price_per_hour * discount
        ):
            return True  # ranks above the near-tie limit whatever it predicts
        index = self.index
        if not longest and index is not None:
            blocks = index.run_on(replica_id, self.first_key, self.request.prefix_hashes)
        predictor = self.predictor
        new_tokens = predictor.new_tokens(blocks) if blocks else predictor.uncached_tokens
        terms = predictor.latency(replica, new_tokens, self.tpot_limit)
        if terms is None:
            # Its decode step alone misses TPOT: needed only if nothing meets, and predicted
            # then (CostAware._violation).
            if self.best_meeting == math.inf:
                self.options.append((math.inf, None, None, replica, reason, blocks, False, longest))
            return True
        ttft, tpot, factor, _ = terms
        ttft *= factor
        tpot *= factor
        meets = ttft <= self.ttft_limit and tpot <= self.tpot_limit
        if longest:
            discount -= self._prefix_discount(ttft, tpot, longest, self.tpot_limit_on(replica))
            reason = Reason.PREFIX_AFFINITY
        rank_price = replica.price_per_hour * discount
        if meets and rank_price < self.best_meeting:
            self.best_meeting = rank_price
        self.options.append((rank_price, ttft, tpot, replica, reason, blocks, meets, longest))
        return True

    def deferred_rank(self, option: _Option) -> float:
        """The rank `consider` would have given a deferred option, from its prediction:
        the price less the adapter's and the prefix's discounts."""
        replica, longest = option[_REPLICA], option[_LONGEST]
        adapter = self.adapter
        discount = 1.0
        if adapter is not None and adapter in replica.adapters_loaded:
            discount -= self.config.adapter_bonus
        if longest:
            prediction = self.predictor.predict(replica, option[_BLOCKS])
            discount -= self._prefix_discount(
                prediction.ttft_s, prediction.tpot_s, longest, self.tpot_limit_on(replica)
            )
        return replica.price_per_hour * discount

    def load(self, option: _Option) -> float:
        """How near the option's prediction is to the tighter of its two limits (1: at the
        limit): the share of the objective it uses on the clock that binds."""
        ttft, tpot = option[_TTFT], option[_TPOT]
        assert ttft is not None and tpot is not None  # meeting options are predicted
        return self._used(ttft, tpot, self.tpot_limit_on(option[_REPLICA]))

    def harmless(self, option: _Option) -> bool:
        """Whether a predicted option keeps the replica's decode step within the limit of
        the tightest TPOT objective decoding there (`tpot_limit_on`)."""
        tpot = option[_TPOT]
        assert tpot is not None  # meeting options are predicted
        return tpot <= self.tpot_limit_on(option[_REPLICA])

    def tpot_limit_on(self, replica: ReplicaState) -> float:
        """The TPOT a request may bring the replica to: its own objective's limit, or the
        tightest of the requests decoding there, whichever is lower (times the margin)."""
        guard = replica.tightest_tpot_s * self.tpot_margin
        return guard if guard < self.tpot_limit else self.tpot_limit

    def _used(self, ttft: float, tpot: float, tpot_limit: float) -> float:
        return max(ttft / self.ttft_limit, tpot / tpot_limit)

    def _prefix_discount(self, ttft: float, tpot: float, blocks: int, tpot_limit: float) -> float:
        """The prefix holder's discount: worth less the closer it is to either limit
        (a holder that meets TTFT by decoding slowly saves little), none at them; past
        them `prefix_bonus_floor` of it, ranking it among the options that miss."""
        config = self.config
        headroom = 1.0 - self._used(ttft, tpot, tpot_limit)
        if headroom <= 0.0:
            if ttft <= self.ttft_limit and tpot <= self.tpot_limit:
                return 0.0  # it meets, on the edge of harm: no pull towards it
            headroom = config.prefix_bonus_floor
        return config.prefix_bonus * headroom * blocks / self.total_blocks


POLICIES: dict[str, type[RoundRobin | LeastLoad | WeightedScorer | CostAware]] = {
    policy.name: policy for policy in (RoundRobin, LeastLoad, WeightedScorer, CostAware)
}
