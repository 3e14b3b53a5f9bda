"""The cost-aware policy's fast path (predictions inline, predictions of candidates that
cannot change the outcome skipped or deferred) decides exactly as an exhaustive search
over `predict` does, on small fleets scanned in full: with near ties switched off, the one
answer; with them on, one of the near ties meeting the SLO (two are drawn of them), or the
one least-bad answer when none meets."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs
from serving.router import (
    CostAware,
    DeploymentRoute,
    ModelRoute,
    ReplicaPerf,
    ReplicaState,
    RouterConfig,
    RouteRequest,
    RouterState,
    is_candidate,
    predict,
)
from serving.router.coefficients import coefficients_from_perf

MODEL = "llama-3.1-8b"
NOW = 1_000.0
HASHES = (101, 102, 103, 104)
# Every group scanned in full and no near-tie draw: the answer is unique, no sampling.
EXHAUSTIVE = RouterConfig(near_tie_fraction=0.0, full_scan_max=1_000)
# The default near tie: the least-bad path takes the least miss within it.
EXHAUSTIVE_NEAR_TIE = RouterConfig(full_scan_max=1_000)
# The same without giving way when nothing meets (neither a looser tier to tighter ones
# nor a request that misses everywhere to those that can still meet).
EXHAUSTIVE_NO_YIELD = RouterConfig(
    near_tie_fraction=0.0,
    full_scan_max=1_000,
    yield_to_tighter_tiers=False,
    yield_when_lost=False,
)


def shapes() -> list[ReplicaPerf]:
    model = load_model_specs()[MODEL]
    return [
        coefficients_from_perf(PerfModel(spec, model))
        for name, spec in sorted(load_gpu_specs().items())
        if name in {"H100-SXM-80GB", "A100-SXM-80GB", "L40S-48GB", "L4-24GB"}
    ]


PERFS = shapes()

replica_fields = st.fixed_dictionaries(
    {
        "shape": st.integers(0, len(PERFS) - 1),
        # Half of them within a few per cent of each other: near ties, on every path.
        "price": st.floats(0.5, 5.0) | st.floats(1.0, 1.08),
        "region": st.sampled_from(("eu-west", "us-east")),
        "running": st.integers(0, 300),
        "waiting": st.integers(0, 20),
        "inflight": st.integers(0, 12),
        "prefill_pending_tokens": st.integers(0, 20_000),
        "prompt_rate": st.floats(0.0, 5_000.0),
        "rate_age": st.floats(0.0, 60.0),
        "kv_usage": st.floats(0.0, 1.0),
        "telemetry_age": st.floats(0.0, 40.0),
        "adapter": st.booleans(),
        "max_loras": st.integers(0, 2),
        "healthy": st.booleans() | st.just(True),
        "prefix_blocks": st.integers(0, len(HASHES)),
    }
)

request_fields = st.fixed_dictionaries(
    {
        "tier": st.sampled_from(("interactive", "standard", "batch")),
        "prompt_tokens": st.integers(1, 30_000),
        "max_tokens": st.integers(1, 2_048),
        "adapter": st.sampled_from((None, "support-bot")),
        "prefix": st.booleans(),
        "eu_only": st.booleans(),
    }
)


def build(fields: list[dict], seed: int) -> RouterState:
    replicas = [
        ReplicaState(
            replica_id=f"r{index}",
            deployment_id="stable",
            model=MODEL,
            version="v1",
            pool="pool",
            gpu_class=f"shape-{f['shape']}",
            region=f["region"],
            # Distinct prices: one cheapest answer, never a tie to draw between.
            price_per_hour=f["price"] + index * 1e-6,
            perf=PERFS[f["shape"]],
            running=f["running"],
            waiting=f["waiting"],
            kv_usage=f["kv_usage"],
            inflight=f["inflight"],
            prefill_pending_tokens=f["prefill_pending_tokens"],
            prompt_rate=f["prompt_rate"],
            prompt_rate_at=NOW - f["rate_age"],
            adapters_loaded=frozenset({"support-bot"}) if f["adapter"] else frozenset(),
            max_loras=f["max_loras"],
            healthy=f["healthy"],
            telemetry_at=NOW - f["telemetry_age"],
        )
        for index, f in enumerate(fields)
    ]
    route = ModelRoute(MODEL, (DeploymentRoute("stable", "v1", 100),))
    state = RouterState([route], replicas, seed=seed)
    for index, f in enumerate(fields):
        if f["prefix_blocks"]:
            state.prefix_index.record("acme", HASHES[: f["prefix_blocks"]], f"r{index}")
    return state


def exhaustive_choice(
    state: RouterState, request: RouteRequest, config: RouterConfig
) -> tuple[set[str], bool]:
    """Every candidate predicted with `predict`: the cheapest meeting one; else, for a tier
    looser than the tightest objective (`yield_to_tighter_tiers`) or missing its objective
    on every candidate (`yield_when_lost`), of those missing by at most
    `queue_over_slo_factor` (by any amount, for a request missing everywhere), of those,
    for a looser tier, the ones within its objectives when there are any,
    and priced within the near tie of the cheapest of them, the one missing least (the
    cheaper between equal misses); else the least bad (the smallest miss, the cheaper
    between equal misses). Returns every replica the policy may choose: the near ties
    meeting the SLO, or those tied for the least-bad answer. No request decodes in the
    fleet, so no option harms another's TPOT."""
    tier = config.tier(request.tier)
    ttft_limit = math.inf if tier.ttft_s is None else tier.ttft_s * config.ttft_margin
    tpot_limit = math.inf if tier.tpot_s is None else tier.tpot_s * config.tpot_margin
    matches = (
        state.prefix_index.longest_matches(request.tenant, request.prefix_hashes)
        if request.prefix_hashes
        else {}
    )
    # A replica outside the longest match predicts with its own run of the prefix, which
    # earns no discount (`_Candidates.consider`).
    first_key = (
        state.prefix_index.first_key(request.tenant, request.prefix_hashes) if matches else None
    )
    meeting: list[tuple[float, str]] = []
    missing: list[tuple[tuple[float, float], str]] = []
    for group in state.groups("stable"):
        for replica in group.live:
            if not is_candidate(replica, request, NOW, config):
                continue
            blocks = longest = matches.get(replica.replica_id, 0)
            if not longest and first_key is not None:
                blocks = state.prefix_index.run_on(
                    replica.replica_id, first_key, request.prefix_hashes
                )
            prediction = predict(replica, request, NOW, config, blocks)
            discount = 1.0
            if request.adapter is not None and request.adapter in replica.adapters_loaded:
                discount -= config.adapter_bonus
            if longest:
                headroom = 1.0 - max(prediction.ttft_s / ttft_limit, prediction.tpot_s / tpot_limit)
                meets = prediction.ttft_s <= ttft_limit and prediction.tpot_s <= tpot_limit
                if headroom <= 0.0 and not meets:
                    headroom = config.prefix_bonus_floor  # a missing holder keeps some
                if headroom > 0.0:
                    discount -= config.prefix_bonus * headroom * blocks / len(HASHES)
            if prediction.ttft_s <= ttft_limit and prediction.tpot_s <= tpot_limit:
                meeting.append((replica.price_per_hour * discount, replica.replica_id))
            else:
                violation = max(
                    0.0 if tier.ttft_s is None else prediction.ttft_s / tier.ttft_s,
                    0.0 if tier.tpot_s is None else prediction.tpot_s / tier.tpot_s,
                )
                missing.append(((violation, replica.price_per_hour * discount), replica.replica_id))
    near_tie = 1.0 + config.near_tie_fraction
    if meeting:
        limit = min(meeting)[0] * near_tie
        return {replica_id for price, replica_id in meeting if price <= limit}, True
    objectives = [t.ttft_s for t in config.slo_tiers.values() if t.ttft_s is not None]
    least = min((violation for (violation, _), _ in missing), default=0.0)
    lost = config.yield_when_lost and bool(missing) and least > 1.0
    looser = (
        config.yield_to_tighter_tiers
        and bool(objectives)
        and (tier.ttft_s is None or tier.ttft_s > min(objectives))
    )
    yields = lost or looser
    cap = math.inf if lost else config.queue_over_slo_factor
    tolerable = [
        ((price, violation), replica_id)
        for (violation, price), replica_id in missing
        if violation <= cap
    ]
    # A looser tier keeps to those where it still meets its objectives (outside the
    # margin), when there are any, whatever a prefix holder's discount.
    still = [option for option in tolerable if option[0][1] <= 1.0]
    if looser and still:
        tolerable = still
    if yields and tolerable:
        # Within the near tie of the cheapest tolerable price, the smallest miss; then price.
        limit = min(price for (price, _), _ in tolerable) * near_tie
        tied = [((v, p), replica_id) for (p, v), replica_id in tolerable if p <= limit]
        best_tied = min(key for key, _ in tied)
        return {replica_id for key, replica_id in tied if key == best_tied}, False
    if missing:
        best = min(key for key, _ in missing)
        return {replica_id for key, replica_id in missing if key == best}, False
    return set(), False


@pytest.mark.parametrize(
    "config",
    [EXHAUSTIVE, EXHAUSTIVE_NO_YIELD, EXHAUSTIVE_NEAR_TIE],
    ids=["yield", "no-yield", "near-tie"],
)
@settings(max_examples=1000, deadline=None)
@given(
    fleet=st.lists(replica_fields, min_size=1, max_size=8),
    ask=request_fields,
    seed=st.integers(0, 1_000),
)
def test_cost_aware_decides_as_an_exhaustive_search_over_predict(
    config: RouterConfig, fleet: list[dict], ask: dict, seed: int
) -> None:
    state = build(fleet, seed)
    request = RouteRequest(
        model=MODEL,
        tenant="acme",
        tier=ask["tier"],
        prompt_tokens=ask["prompt_tokens"],
        max_tokens=ask["max_tokens"],
        request_id="req-1",
        adapter=ask["adapter"],
        prefix_hashes=HASHES if ask["prefix"] else (),
        allowed_regions=frozenset({"eu-west"}) if ask["eu_only"] else None,
    )
    expected_ids, expected_meets = exhaustive_choice(state, request, config)

    decision = CostAware(state, config).choose(request, NOW)

    chosen = decision.replica
    assert (chosen is None) == (not expected_ids)
    if chosen is not None:
        assert chosen.replica_id in expected_ids
    if chosen is not None:
        assert decision.meets_slo == expected_meets
        blocks = decision.cached_tokens // config.prefix_block_tokens
        assert decision.predicted_ttft_s == predict(chosen, request, NOW, config, blocks).ttft_s
