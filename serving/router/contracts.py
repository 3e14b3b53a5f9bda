"""The plain data the router takes and returns.

Nothing here imports Django or the engine model: whoever builds the routing table turns
the engine model into `ReplicaPerf` coefficients once per replica, and the hot path only
does arithmetic on them.
"""

from __future__ import annotations

import copyreg
import math
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Literal, cast

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Tier = Literal["interactive", "standard", "batch"]

# Lower rank is served first by the admission queue; also the order tiers are listed in.
TIER_RANK: dict[str, int] = {"interactive": 0, "standard": 1, "batch": 2}

# Time constant of each replica's prompt-token rate: about one request's decode lifetime
# (a few hundred tokens at 20-40 ms a step), the span over which other requests' prefills
# interrupt its decode steps. It was 20 s, which let a burst of prefills onto a prefix
# holder go unseen for most of the decodes it slowed.
PROMPT_RATE_WINDOW_S = 5.0


@dataclass(slots=True, frozen=True)
class RouteRequest:
    model: str
    tenant: str
    tier: Tier
    prompt_tokens: int
    max_tokens: int
    request_id: str
    adapter: str | None = None
    # Tenant-salted hashes of the prompt's first KV blocks, in prompt order (block i's hash
    # chains block i-1's, as vLLM's prefix cache does), so a match is always a prefix.
    prefix_hashes: tuple[int, ...] = ()
    allowed_regions: frozenset[str] | None = None


@dataclass(slots=True, frozen=True)
class ReplicaPerf:
    """A linearisation of the roofline, enough to predict TTFT and TPOT in a few flops.

    prefill time of n new tokens  ~ prefill_base_s + prefill_s_per_token * n
    decode step with b sequences  ~ decode_base_s + decode_s_per_seq * b
                                  + decode_s_per_kv_token * max(0, kv - b * typical_context)
    step computing n tokens       ~ max(its decode step, or decode_base_s with no decode,
                                        compute_base_s + prefill_s_per_token * n)

    The decode terms are the fit at `typical_context_tokens` of KV per sequence; a batch
    holding more KV than that (long prompts) reads it every step, which the third adds.
    `prefill_base_s` is at least a one-token prefill (reading the weights once), so the
    first line is a whole prompt's prefill from above. One engine step streams the weights
    and KV while it computes, and lasts the longer of the two: a step of n tokens (prefill
    chunks and decodes alike) computes for `compute_base_s` plus the slope, without the
    weights' read that `prefill_base_s` holds, and reads for at least `decode_base_s`.
    """

    prefill_s_per_token: float
    prefill_base_s: float
    compute_base_s: float
    decode_base_s: float
    decode_s_per_seq: float
    kv_capacity_tokens: int
    max_num_seqs: int
    # Prompt tokens (prefill chunks plus decodes) the engine schedules per step.
    max_num_batched_tokens: int = 8192
    # KV bytes per token of the model as served: what a disaggregated hand-off moves.
    kv_bytes_per_token: int = 0
    # A decode step's cost of each KV token read beyond the fit's context per sequence.
    decode_s_per_kv_token: float = 0.0
    typical_context_tokens: int = 1024


# Engine roles (disaggregated serving): prefill-only, decode-only, or both on one replica.
COLOCATED = "colocated"
PREFILL = "prefill"
DECODE = "decode"


@dataclass(slots=True, frozen=True)
class KvLink:
    """A replica's end of the link its KV cache is handed over on (its NIC, or NVLink)."""

    gbytes_per_s: float
    latency_s: float

    def transfer_s(self, other: KvLink, nbytes: float) -> float:
        """Between this end and `other`: the lower bandwidth, the higher latency."""
        bandwidth = min(self.gbytes_per_s, other.gbytes_per_s) * 1e9
        return max(self.latency_s, other.latency_s) + nbytes / bandwidth


@dataclass(slots=True)
class ReplicaState:
    """One replica as the router sees it: static placement facts plus the latest telemetry.

    Mutable on purpose: `RouterState` updates telemetry fields in place so the candidate
    index never has to be rebuilt between routing-table versions.
    """

    replica_id: str
    deployment_id: str
    model: str
    version: str
    pool: str
    gpu_class: str
    region: str
    # The whole replica's price: price per GPU-hour times its tensor-parallel GPUs.
    price_per_hour: float
    perf: ReplicaPerf
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    # The requests in flight on the replica that this gateway knows of, its own and those
    # the other gateways told it of; fresher than telemetry.
    inflight: int = 0
    # Prompt tokens of those requests, and of the ones among them still waiting for their
    # first token (prefill work queued ahead of the next request).
    inflight_prompt_tokens: int = 0
    # The whole prompts of those requests, cached prefix included: each decode step reads
    # every sequence's KV, shared blocks once per sequence.
    inflight_context_tokens: int = 0
    prefill_pending_tokens: int = 0
    # Of those, the ones this gateway sent that the other gateways do not know of yet (the
    # in-flight counts travel between gateways in batches, `RouterState.request_synced`),
    # and their prefill: each other gateway, routing on the same view meanwhile, is
    # assumed to have sent as many here (`RouterConfig.gateways`).
    unsynced: int = 0
    unsynced_prefill_tokens: int = 0
    # Prompt tokens sent here per second, an exponentially decayed average as of
    # `prompt_rate_at`: the prefill work that will keep interrupting the replica's decodes.
    prompt_rate: float = 0.0
    prompt_rate_at: float = 0.0
    # The prefills sent here per second, decayed alike as of `prompt_rate_at`: with
    # `prompt_rate`, the mean prompt, which sizes the prefill chunks that ride with decodes.
    prefill_rate: float = 0.0
    # The requests counted here that finished there per second, decayed alike as of
    # `finish_rate_at`: how fast a full batch frees slots for the requests queued behind it.
    # `finish_rate_since`: when the first request counted here was sent (0: never), for the
    # warm-up of this average and of the prompt and prefill rates (see `predict.warm_up`).
    finish_rate: float = 0.0
    finish_rate_at: float = 0.0
    finish_rate_since: float = 0.0
    # The TPOT objectives of the requests counted there -> how many, and the
    # tightest of them (inf: none): every sequence there decodes in the same steps, so a
    # request sent there must keep the step within it, whatever its own tier allows.
    inflight_tpot_objectives: dict[float, int] = field(default_factory=dict)
    tightest_tpot_s: float = math.inf
    adapters_loaded: frozenset[str] = frozenset()
    max_loras: int = 0
    healthy: bool = True
    # Monotonic seconds; the replica is skipped until then.
    breaker_open_until: float = 0.0
    # Monotonic seconds at which the telemetry above was scraped.
    telemetry_at: float = 0.0
    # What the predicted TTFT there is multiplied by: a running quantile
    # (`RouterConfig.ttft_quantile`) of the first tokens this gateway saw there over what
    # it had predicted for them (`RouterState.observe_ttft`). The engine is not the model:
    # a queue the prefix cache thins or thickens, a kernel faster or slower than the fit.
    ttft_scale: float = 1.0
    # COLOCATED, PREFILL or DECODE; only the disaggregated policy routes to the last two.
    role: str = COLOCATED
    kv_link: KvLink | None = None


@dataclass(slots=True, frozen=True)
class SloTier:
    """Latency objective of a priority tier; None means the tier has no objective."""

    name: str
    ttft_s: float | None
    tpot_s: float | None

    def missed(self, ttft_s: float | None, tpot_s: float | None) -> str | None:
        """Which clock a served request missed, "ttft" first, or None when it met both.
        `ttft_s` None: it never had a first token. `tpot_s` None: fewer than two tokens,
        no TPOT to miss. The SLO is both clocks; a tier without objectives misses none."""
        if self.ttft_s is None and self.tpot_s is None:
            return None
        if ttft_s is None:
            return "ttft"
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return "ttft"
        if tpot_s is not None and self.tpot_s is not None and tpot_s > self.tpot_s:
            return "tpot"
        return None


# Answers the SLO does not judge: the client's doing, not the platform's (`slo_outcome`).
NOT_JUDGED_STATUSES = ("client_cancelled", "refused")


def time_per_output_token(
    first_token: float | None, end: float | None, tokens: int
) -> float | None:
    """The SLO's second clock: the time from a request's first token to its last over its
    tokens less one, in the unit of `first_token` and `end` (two instants, or TTFT and the
    total from one start); None without a first token or an end, or under two tokens. The
    gateway's metric, the usage event and the simulator's records all time it so."""
    if first_token is None or end is None or tokens < 2:
        return None
    return max(0.0, end - first_token) / (tokens - 1)


def slo_outcome(
    tier: SloTier | None, status: str, ttft_s: float | None, tpot_s: float | None
) -> str | None:
    """How an answer stands against its tier's SLO: "met", "ttft" or "tpot" (the clock it
    missed) or "failed" (status not "ok": admitted and not answered, for want of capacity or
    by a failure); None when it is not judged: a tier without objectives, a client that hung
    up ("client_cancelled"), or a request the engine refused as the client wrote it
    ("refused": longer than the model's context, a parameter it does not accept, the
    client's doing, as a hang-up is; counting it would let one client's bad requests page
    the platform's operators). The gateway's metric, the
    console's figures (in SQL, `serving.console.queries`) and the usage records judge by
    this; the simulator's report by the same rule over its records."""
    if tier is None or (tier.ttft_s is None and tier.tpot_s is None):
        return None
    if status in NOT_JUDGED_STATUSES:
        return None
    if status != "ok":
        return "failed"
    return tier.missed(ttft_s, tpot_s) or "met"


# Defaults, overridden by configuration. Interactive: a chat user notices a first token
# after about a second and reads at ~20 tokens/s, so 50 ms per token keeps ahead of them.
# Standard: API callers tolerate a few seconds and ~10 tokens/s. Batch: throughput only.
DEFAULT_SLO_TIERS: dict[str, SloTier] = {
    "interactive": SloTier("interactive", ttft_s=1.0, tpot_s=0.05),
    "standard": SloTier("standard", ttft_s=3.0, tpot_s=0.1),
    "batch": SloTier("batch", ttft_s=None, tpot_s=None),
}


@dataclass(slots=True, frozen=True)
class RouterConfig:
    slo_tiers: dict[str, SloTier] = field(default_factory=lambda: dict(DEFAULT_SLO_TIERS))
    # Telemetry older than this makes a replica's prediction pessimistic ...
    stale_after_s: float = 5.0
    # ... by this factor on both TTFT and TPOT ...
    stale_penalty: float = 1.5
    # ... and older than this removes the replica from the candidates altogether.
    dead_after_s: float = 30.0
    # Above this KV use, preemptions start; TPOT grows linearly to x(1 + kv_inflation) at 100%.
    kv_high_watermark: float = 0.9
    kv_inflation: float = 1.0
    # Prompt tokens assumed for each request the telemetry shows queued beyond this
    # gateway's own pending prefills (another gateway's requests; their sizes are unknown).
    assumed_queued_prompt_tokens: int = 512
    # A replica is accepted only when its predicted TTFT is within `ttft_margin` of the
    # objective and its TPOT within `tpot_margin`: the prediction is a model of the engine
    # and future arrivals are estimated. TTFT keeps the smaller margin because its
    # prediction is calibrated online to a high quantile of what each replica does
    # (`ttft_quantile`), so the scale carries most of its safety; TPOT's prediction is not
    # (a TPOT scale was tried and not kept, bench/RESULTS.md), so it keeps the whole margin.
    # Each family's answer of the homogeneous search on four classes, and one replica
    # below it, on three arrival seeds: with 0.9 on TTFT the fleet one below met the SLO
    # in 24 of the 72 cases (0.8 on both: 22; 1.0 on TTFT: 17), and the answers met as
    # often. 0.9 on both failed three answers on the first seed (rag over 28 L40S, diurnal
    # over 27 A100 and over 19 RTX PRO 6000).
    ttft_margin: float = 0.9
    tpot_margin: float = 0.8
    # Prefill work above this fraction of a replica's time is treated as this fraction:
    # the rest of its steps are taken to decode alone.
    max_prefill_share: float = 0.95
    # Tokens per prefix-hash block (vLLM's default KV block size).
    prefix_block_tokens: int = 16
    # Loading a LoRA adapter that is not resident delays the first token by about this.
    adapter_load_s: float = 0.25
    # Affinity bonuses, as a discount on the replica's price when ranking: a replica that
    # holds the whole prefix ranks as if it were 25% cheaper, one with the adapter loaded
    # 15% cheaper. Enough to beat a small price difference (an A100 pool priced a few
    # percent under an H100 pool), never a large one (an L4 at a quarter of the price).
    # The prefix bonus shrinks as the holder's predicted TTFT or TPOT nears its objective,
    # so a hot prefix does not pile traffic onto its holder. A holder predicted to miss
    # keeps this share of it: it still saves the prefill, compute every request on the
    # fleet gets back, so between replicas that all miss (an overload, a cold start with
    # every cache empty) it should still draw its prefix's requests first, where it holds
    # enough of the prompt to rank past the near tie (least harm decides within it).
    prefix_bonus: float = 0.25
    prefix_bonus_floor: float = 0.5
    adapter_bonus: float = 0.15
    # Candidates within this fraction of the cheapest ranked price are a near tie; two of
    # them are drawn and the one using less of its objective on the clock that binds wins.
    near_tie_fraction: float = 0.05
    # Random replicas examined per homogeneous group when the group is large.
    samples_per_group: int = 2
    # Groups with up to this many live replicas are examined in full (exact answers for
    # small fleets); larger ones are sampled.
    full_scan_max: int = 4
    # When a draw finds no replica to settle on (none meets harmlessly or, for a looser
    # tier, none is free of tighter tiers' requests), up to this many more draws of
    # `samples_per_group` per group before deciding: a busy fleet is where the choice
    # matters. Generation over 21 L40S, interactive requests within both clocks on three
    # seeds: 90.65 / 90.42 / 91.00 % with none, 95.73 / 97.88 / 97.97 % with one, 99.22 /
    # 99.48 / 99.39 % with two (least load needs 22).
    redraws_when_unsettled: int = 2
    # When nothing meets the SLO and the least bad misses it by more than this factor,
    # the decision advises the gateway to queue (or refuse) rather than send.
    queue_over_slo_factor: float = 1.5
    # A request of a looser tier than the tightest is advised to wait in the gateway's
    # admission queue when, wherever it goes, it would wait longer than this share of the
    # tightest TTFT objective before its own prefill: the queue is already as long as a
    # tighter request can bear, and it would lengthen it (the gateway sends it when a slot
    # frees or the telemetry shows room). None (the default): never. At 0.5 it keeps 98.5-
    # 99.9 % of bursty's interactive requests within both clocks over 4 H100 where 78-85 %
    # were, but costs the standard tier its own objectives elsewhere (diurnal over 8 H100:
    # 74 % of standard within both clocks, against 98 %; chat's mixed fleet with sixteen
    # gateways: 39 %), so it is a choice for a deployment, not the default
    # (bench/RESULTS.md, "Looser tiers deferred at the gateway").
    defer_looser_after: float | None = None
    # ... for at most this share of its own TTFT objective (as routed, `untimed_ttft_s` for a
    # tier without one): a slot freed after that goes to it wherever the router sends it.
    defer_looser_for: float = 0.5
    # When nothing meets the SLO, a request of a looser tier than the tightest configured
    # takes the cheapest replica missing its objective by at most `queue_over_slo_factor`
    # instead of the least bad: in an overload it leaves the fast replicas to the tier that
    # needs them, rather than queueing its own long prompts there.
    yield_to_tighter_tiers: bool = True
    # Likewise for a request of any tier predicted to miss its objective on every candidate:
    # it is lost to the SLO wherever it goes, so it takes the cheapest replica, however far
    # it misses there, and leaves the fast ones to requests that can still meet theirs (its
    # prefill there would push them over too).
    yield_when_lost: bool = True
    # Gateway processes sharing the traffic. Each tells the others of the requests it sends
    # (serving/gateway/inflight_sync.py), so its counts are everyone's but for the last
    # few milliseconds; the load balancer in front deals requests to them alike, so each
    # takes its own requests the others do not know of yet this many times over (and, with
    # the others unreachable, all its own: nothing it sends becomes known).
    gateways: int = 1
    # A tier without a TTFT objective (batch) promises no latency, but its requests must
    # not wait without end: they are routed as if this were their TTFT objective. Without
    # it they met everywhere, and the least harm sent them all to the one replica decoding
    # no tighter tier's requests, whose queue then grew with the run (rag on 36 L40S: 425
    # of 439 batch requests on one replica, first tokens 65 s late on a 30 s run, 299 s on
    # a 120 s run). Twice the gateway's queue aging (`GatewayConfig.queue_aging_s`), after
    # which a queued batch request goes before a new interactive one. None: no bound.
    untimed_ttft_s: float | None = 20.0
    # The quantile of observed over predicted TTFT each replica's `ttft_scale` tracks (None:
    # no calibration, the scale stays 1), moved by `ttft_quantile_step` at each first token
    # and kept within `ttft_scale_bounds`. First tokens predicted sooner than
    # `ttft_calibration_min_s` teach it nothing: an idle replica's prefill is the fit's.
    # High, since the least-bad path accepts a prediction up to the objective itself: the
    # scale is that path's margin. Mixed fleets of equal budget, five seeds, interactive
    # within both clocks: chat over 2 H100 + 7 L40S 59.89 % at 0.90, 61.64 at 0.95, 64.06
    # at 0.98 (58.61 with no calibration and the model before the queued prompts came off
    # the decode batch); code over 1 H100 + 7 L40S 78.98, 81.59, 83.59 (83.81).
    ttft_quantile: float | None = 0.98
    ttft_quantile_step: float = 0.02
    ttft_scale_bounds: tuple[float, float] = (0.5, 2.0)
    ttft_calibration_min_s: float = 0.1
    # `tier`'s answers, built once (the bound filled in).
    _routing_tiers: dict[str, SloTier] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        for name, tier in self.slo_tiers.items():
            self._routing_tiers[name] = self._bounded(tier)

    def tier(self, name: str) -> SloTier:
        """The tier a request of `name` is routed by: its objectives, with `untimed_ttft_s`
        in place of a TTFT objective it lacks."""
        tier = self._routing_tiers.get(name)
        return tier if tier is not None else self._bounded(SloTier(name, None, None))

    def deferral_s(self, name: str) -> float:
        """How long a gateway may keep a request of tier `name` in its admission queue while
        the router still advises it to wait (`defer_looser_after`): `defer_looser_for` of its
        own TTFT objective as routed, for a looser tier than the tightest; 0 for the tightest
        tier, or with deferral off (a freed slot then sends it wherever the router chooses)."""
        objectives = [t.ttft_s for t in self.slo_tiers.values() if t.ttft_s is not None]
        own = self.tier(name).ttft_s
        if self.defer_looser_after is None or own is None or not objectives:
            return 0.0
        return self.defer_looser_for * own if own > min(objectives) else 0.0

    def limits(self, tier: SloTier) -> tuple[float, float]:
        """The TTFT and TPOT a prediction may reach and still be accepted: the tier's
        objectives times their margins (infinity for an objective the tier lacks)."""
        ttft = math.inf if tier.ttft_s is None else tier.ttft_s * self.ttft_margin
        tpot = math.inf if tier.tpot_s is None else tier.tpot_s * self.tpot_margin
        return ttft, tpot

    def _bounded(self, tier: SloTier) -> SloTier:
        if tier.ttft_s is None and self.untimed_ttft_s is not None:
            return replace(tier, ttft_s=self.untimed_ttft_s)
        return tier


class Reason(StrEnum):
    CHEAPEST_MEETING_SLO = "cheapest_meeting_slo"
    PREFIX_AFFINITY = "prefix_affinity"
    ADAPTER_AFFINITY = "adapter_affinity"
    LEAST_BAD = "least_bad"
    DISAGGREGATED = "disaggregated"
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    SCORED = "scored"
    NO_CANDIDATES = "no_candidates"
    UNKNOWN_MODEL = "unknown_model"


# Not frozen: a frozen dataclass pays object.__setattr__ per field, on every decision.
@dataclass(slots=True)
class Decision:
    replica: ReplicaState | None
    reason: Reason
    policy: str
    deployment_id: str | None = None
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    # Replica price times the request's fair share of the replica's time (see predict.py).
    predicted_cost_usd: float | None = None
    # Prompt tokens the router expects the replica's prefix cache to hold: the caller passes
    # prompt_tokens minus this to RouterState.request_started as the prefill to do.
    cached_tokens: int = 0
    meets_slo: bool = True
    # The TPOT objective that requests sent there later must keep this one's decode within
    # (its tier's; None: none, or a policy that does not weigh it): pass it to
    # RouterState.request_started and request_finished.
    tpot_objective_s: float | None = None
    # True when nothing meets the SLO by a wide margin: the gateway should hold the request
    # in the admission queue, or refuse it with Retry-After, rather than send it now.
    queue_advised: bool = False
    # Where the baseline policy (least load) would have sent the request at the same moment
    # among the same candidates (`policies.least_load_pick`), so metering can price the
    # request's work there too. Set whenever `replica` is: least load walks every live
    # replica of the versions (all their deployments) the policy looked in.
    baseline_replica: ReplicaState | None = None
    # Disaggregated: the replica that prefills (`replica` then decodes and streams) and the
    # predicted KV transfer between them, part of `predicted_ttft_s`.
    prefill_replica: ReplicaState | None = None
    predicted_transfer_s: float = 0.0
    # The replica's `ttft_scale` in `predicted_ttft_s` (None: a prediction not to learn
    # from): pass the two to `RouterState.observe_ttft` with the first token's TTFT.
    ttft_scale: float | None = None


@dataclass(slots=True, frozen=True)
class DeploymentRoute:
    """One deployment serving a model name, with its share of traffic in percent: its
    version's share is the sum of the version's deployments' weights."""

    deployment_id: str
    version: str
    weight: int


@dataclass(slots=True, frozen=True)
class VersionRoute:
    """One version of a served model: its deployments that take traffic (weight above 0,
    in the route's order) and its weight, the sum of theirs.

    The canary split chooses a version; the policy then chooses among the replicas of all
    of its deployments, which sit on different pools (GPU classes, regions).
    """

    version: str
    weight: int
    deployments: tuple[DeploymentRoute, ...]
    deployment_ids: frozenset[str]


@dataclass(slots=True, frozen=True)
class ModelRoute:
    """Routing-table entry of one served model name.

    `cohort_by_tenant` splits canary traffic by tenant instead of by request, so one
    tenant sees one version throughout a rollout. `versions` is derived from `deployments`
    once, here, so a decision never regroups them.
    """

    model: str
    deployments: tuple[DeploymentRoute, ...]
    cohort_by_tenant: bool = False
    # The versions with weight above 0, in the order each first appears in `deployments`.
    versions: tuple[VersionRoute, ...] = field(init=False, repr=False, compare=False)
    # The same versions, heaviest first (ties in route order): the fallback order.
    versions_by_weight: tuple[VersionRoute, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        members: dict[str, list[DeploymentRoute]] = {}
        for deployment in self.deployments:
            if deployment.weight > 0:  # weight 0 drains a deployment (a rollout's start)
                members.setdefault(deployment.version, []).append(deployment)
        versions = tuple(
            VersionRoute(
                version,
                sum(d.weight for d in deployments),
                tuple(deployments),
                frozenset(d.deployment_id for d in deployments),
            )
            for version, deployments in members.items()
        )
        # object.__setattr__: the dataclass is frozen, and these are set once, at birth.
        object.__setattr__(self, "versions", versions)
        object.__setattr__(
            self, "versions_by_weight", tuple(sorted(versions, key=lambda v: -v.weight))
        )


def _by_constructor(contract: object) -> tuple[type, tuple[object, ...]]:
    init = (f.name for f in fields(cast("DataclassInstance", contract)) if f.init)
    return type(contract), tuple(getattr(contract, name) for name in init)


def pickle_by_constructor(*frozen: type) -> None:
    """Pickle these frozen dataclasses as calls of their constructors: the benchmark pools'
    workers receive them, and a compiled build's class (`serving/router/native.py`) cannot be
    restored field by field past its frozen `__setattr__`. Every frozen dataclass of the
    compiled modules is registered (tests/serving/test_router_native.py checks it)."""
    for cls in frozen:
        copyreg.pickle(cls, _by_constructor)


pickle_by_constructor(
    RouteRequest,
    ReplicaPerf,
    KvLink,
    SloTier,
    RouterConfig,
    DeploymentRoute,
    VersionRoute,
    ModelRoute,
)
