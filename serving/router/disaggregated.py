"""Disaggregated routing: a prefill replica and a decode replica chosen together, or a
colocated replica where that is predicted cheaper.

For a pair (P prefills, D decodes), with the terms of `predict.py`:

    prefill     = P's idle prefill of (queued on P + new tokens), in steps of K tokens each
                  the longer of its compute and the weights' read (`idle_prefill_s`)
                  (new tokens: the prompt less what P's prefix cache holds for the tenant)
    transfer    = latency + prompt_tokens x kv_bytes_per_token / bandwidth
                  (the slower end of P's and D's links, `KvLink.transfer_s`)
    step        = decode_base_s + decode_s_per_seq x (batch on D + 1)
    TTFT        = prefill + transfer + 2 x step   (wait for D's step boundary, then the step
                                                   that samples the first token)
    TPOT        = step                            (a decode replica runs no prefill, so no
                                                   prefill share slows it, unlike colocated)
    cost        = P's price x own prefill + D's price x (max_tokens x TPOT + transfer
                  + 2 x step) / (batch + 1)       (D holds the KV from the transfer on)

each times the KV-pressure and stale-telemetry factors of the replica it is about. A decode
replica whose free KV (telemetry's share of its capacity) cannot hold the prompt and the
output is not a candidate. Colocated candidates' TTFT and TPOT are `predict`'s, as the
cost-aware policy's are (the prefill share of their own and others' prompts inflating TPOT);
their cost counts decode steps without that inflation (`colocated_option`), since other
prompts' prefill is their own cost, as it is on a prefill replica.

The choice: the cheapest option whose TTFT and TPOT are within their margins of the tier's
objectives (`ttft_margin`, `tpot_margin`); a colocated option within `near_tie_fraction` of
the cheapest pair wins the tie (no transfer to go wrong). So short prompts, whose transfer
and extra decode step cost more than the prefill interference they spare, stay colocated
where both kinds exist, and long prompts go disaggregated when the model says that is
cheaper or the only way to meet TPOT.
When nothing meets: the least bad (the smallest multiple of its objective), flagged
`queue_advised` past `queue_over_slo_factor`.

Pairs are searched over shortlists: the `shortlist` prefill replicas finishing the prompt
soonest and the `shortlist` decode replicas cheapest per request, then every pair of those
(the transfer is the only term coupling them). Ports' backlogs are not in the snapshot, so
the transfer is predicted on idle links. The baseline of a decision (least load's pick in
the other policies) is the chosen replica itself: the saving against least load is a
colocated measure.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from serving.router.canary import versions_in_order
from serving.router.contracts import (
    COLOCATED,
    DECODE,
    PREFILL,
    Decision,
    Reason,
    ReplicaState,
    RouterConfig,
    RouteRequest,
    SloTier,
)
from serving.router.index import RouterState
from serving.router.predict import RequestPredictor, idle_prefill_s, is_candidate


class Option(NamedTuple):
    cost_usd: float
    ttft_s: float
    tpot_s: float
    replica: ReplicaState  # colocated, or the decode replica of a pair
    prefill: ReplicaState | None
    transfer_s: float
    cached_blocks: int


class PrefillTerms(NamedTuple):
    seconds: float  # queue ahead and the prompt's own prefill, factor applied
    own_seconds: float  # the prompt's own prefill, what its GPU time is
    blocks: int


class DecodeTerms(NamedTuple):
    step_s: float  # the decode step the request joins, factor applied
    batch: int


def _factor(replica: ReplicaState, now: float, config: RouterConfig) -> float:
    """KV pressure and telemetry age, as `RequestPredictor.latency` applies them."""
    factor = 1.0
    watermark = config.kv_high_watermark
    if replica.kv_usage > watermark:
        over = (replica.kv_usage - watermark) / (1.0 - watermark)
        factor += config.kv_inflation * min(over, 1.0)
    if now - replica.telemetry_at > config.stale_after_s:
        factor *= config.stale_penalty
    return factor


def prefill_terms(
    replica: ReplicaState, new_tokens: int, blocks: int, now: float, config: RouterConfig
) -> PrefillTerms:
    perf = replica.perf
    ahead = replica.prefill_pending_tokens
    if replica.waiting > replica.inflight:
        ahead += (replica.waiting - replica.inflight) * config.assumed_queued_prompt_tokens
    seconds = idle_prefill_s(perf, ahead + new_tokens)
    own = perf.prefill_base_s + perf.prefill_s_per_token * new_tokens
    return PrefillTerms(seconds * _factor(replica, now, config), own, blocks)


def decode_terms(
    replica: ReplicaState, request: RouteRequest, now: float, config: RouterConfig
) -> DecodeTerms | None:
    """None when the replica's free KV cannot hold the request's prompt and output."""
    perf = replica.perf
    free_tokens = (1.0 - replica.kv_usage) * perf.kv_capacity_tokens
    if free_tokens < request.prompt_tokens + request.max_tokens:
        return None
    load = max(replica.running + replica.waiting, replica.inflight)
    batch = min(load, perf.max_num_seqs)
    step = perf.decode_base_s + perf.decode_s_per_seq * (batch + 1)
    return DecodeTerms(step * _factor(replica, now, config), batch)


def transfer_s(prefill: ReplicaState, decode: ReplicaState, prompt_tokens: int) -> float:
    if prefill.kv_link is None or decode.kv_link is None:
        return math.inf  # not connected for KV hand-off
    return prefill.kv_link.transfer_s(
        decode.kv_link, prompt_tokens * prefill.perf.kv_bytes_per_token
    )


def pair_option(
    prefill: ReplicaState,
    p_terms: PrefillTerms,
    decode: ReplicaState,
    d_terms: DecodeTerms,
    request: RouteRequest,
) -> Option:
    transfer = transfer_s(prefill, decode, request.prompt_tokens)
    step = d_terms.step_s
    ttft = p_terms.seconds + transfer + 2.0 * step
    held_s = (request.max_tokens * step + transfer + 2.0 * step) / (d_terms.batch + 1)
    cost = (prefill.price_per_hour * p_terms.own_seconds + decode.price_per_hour * held_s) / 3600
    return Option(cost, ttft, step, decode, prefill, transfer, p_terms.blocks)


def colocated_option(predictor: RequestPredictor, replica: ReplicaState, blocks: int) -> Option:
    """`predict`'s TTFT and TPOT; the cost counts the decode steps at their length without
    other prompts' prefill, which those prompts pay for as their own (`pair_option` does
    the same), so colocated and disaggregated costs compare like for like."""
    new_tokens = predictor.new_tokens(blocks)
    terms = predictor.latency(replica, new_tokens)
    assert terms is not None  # no step limit: always predicted
    ttft, tpot, factor, batch = terms
    perf = replica.perf
    step = (perf.decode_base_s + perf.decode_s_per_seq * (batch + 1)) * factor
    own_prefill = perf.prefill_base_s + perf.prefill_s_per_token * new_tokens
    held_s = own_prefill + predictor.max_tokens * step / (batch + 1)
    cost = replica.price_per_hour * held_s / 3600
    return Option(cost, ttft * factor, tpot * factor, replica, None, 0.0, blocks)


def _violation(option: Option, tier: SloTier) -> float:
    ratio = 0.0
    if tier.ttft_s is not None:
        ratio = option.ttft_s / tier.ttft_s
    if tier.tpot_s is not None:
        ratio = max(ratio, option.tpot_s / tier.tpot_s)
    return ratio


class Disaggregated:
    name = "disaggregated"

    def __init__(
        self, state: RouterState, config: RouterConfig | None = None, *, shortlist: int = 3
    ) -> None:
        self.state = state
        self.config = config or RouterConfig()
        self.shortlist = shortlist

    def choose(self, request: RouteRequest, now: float) -> Decision:
        state = self.state
        route = state.route(request.model)
        if route is None:
            return Decision(None, Reason.UNKNOWN_MODEL, self.name)
        matches = (
            state.prefix_index.longest_matches(request.tenant, request.prefix_hashes)
            if request.prefix_hashes
            else {}
        )
        for version in versions_in_order(route, request):
            candidates = [
                replica
                for deployment in version.deployments
                for replica in state.live(deployment.deployment_id)
                if is_candidate(replica, request, now, self.config)
            ]
            options = self.options(candidates, request, now, matches)
            if options:
                return self._decide(options, request)
        return Decision(None, Reason.NO_CANDIDATES, self.name)

    def options(
        self,
        candidates: list[ReplicaState],
        request: RouteRequest,
        now: float,
        matches: dict[str, int],
    ) -> list[Option]:
        """Every colocated candidate's option and the shortlisted pairs'."""
        predictor = RequestPredictor(request, now, self.config)
        options: list[Option] = []
        prefills: list[tuple[PrefillTerms, ReplicaState]] = []
        decodes: list[tuple[float, DecodeTerms, ReplicaState]] = []
        for replica in candidates:
            blocks = matches.get(replica.replica_id, 0)
            if replica.role == COLOCATED:
                options.append(colocated_option(predictor, replica, blocks))
            elif replica.role == PREFILL:
                new_tokens = predictor.new_tokens(blocks)
                terms = prefill_terms(replica, new_tokens, blocks, now, self.config)
                prefills.append((terms, replica))
            elif replica.role == DECODE:
                d_terms = decode_terms(replica, request, now, self.config)
                if d_terms is not None:
                    per_request = replica.price_per_hour * d_terms.step_s / (d_terms.batch + 1)
                    decodes.append((per_request, d_terms, replica))
        prefills.sort(key=lambda item: item[0].seconds)
        decodes.sort(key=lambda item: item[0])
        for p_terms, prefill in prefills[: self.shortlist]:
            for _, d_terms, decode in decodes[: self.shortlist]:
                option = pair_option(prefill, p_terms, decode, d_terms, request)
                if option.transfer_s != math.inf:
                    options.append(option)
        return options

    def _decide(self, options: list[Option], request: RouteRequest) -> Decision:
        config = self.config
        tier = config.tier(request.tier)
        ttft_limit, tpot_limit = config.limits(tier)
        meeting = [o for o in options if o.ttft_s <= ttft_limit and o.tpot_s <= tpot_limit]
        queue_advised = False
        if meeting:
            cheapest = min(meeting, key=lambda o: o.cost_usd)
            tie = cheapest.cost_usd * (1.0 + config.near_tie_fraction)
            colocated = [o for o in meeting if o.prefill is None and o.cost_usd <= tie]
            chosen = min(colocated, key=lambda o: o.cost_usd) if colocated else cheapest
            reason = Reason.CHEAPEST_MEETING_SLO if chosen.prefill is None else Reason.DISAGGREGATED
        else:
            chosen = min(options, key=lambda o: (_violation(o, tier), o.cost_usd))
            reason = Reason.LEAST_BAD
            queue_advised = _violation(chosen, tier) > config.queue_over_slo_factor
        cache_holder = chosen.prefill or chosen.replica
        if request.prefix_hashes:
            self.state.prefix_index.record(
                request.tenant, request.prefix_hashes, cache_holder.replica_id
            )
        return Decision(
            chosen.replica,
            reason,
            self.name,
            deployment_id=chosen.replica.deployment_id,
            predicted_ttft_s=chosen.ttft_s,
            predicted_tpot_s=chosen.tpot_s,
            predicted_cost_usd=chosen.cost_usd,
            cached_tokens=chosen.cached_blocks * config.prefix_block_tokens,
            meets_slo=bool(meeting),
            queue_advised=queue_advised,
            baseline_replica=chosen.replica,
            prefill_replica=chosen.prefill,
            predicted_transfer_s=chosen.transfer_s,
            # A colocated choice's TTFT is its replica's, scaled: its first token teaches it.
            ttft_scale=chosen.replica.ttft_scale if chosen.prefill is None else None,
        )
