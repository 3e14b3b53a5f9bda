"""The lower bound on a fleet: what it counts, where it says no fleet can, and that the
simulator's smallest fleet under a real router is never below it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from bench.lookahead import spread_stream
from serving.capacity.lower_bound import lower_bound_replicas, sustained_replicas
from serving.clustersim import (
    FAMILIES,
    LengthClass,
    LengthMix,
    SimConfig,
    SimRequest,
    homogeneous,
    poisson,
    simulate,
    summarize,
)
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs

H100, L40S = "H100-SXM-80GB", "L40S-48GB"


def perf(gpu: str = H100) -> PerfModel:
    return PerfModel(load_gpu_specs()[gpu], load_model_specs()["llama-3.1-8b"])


def stream(
    rate: float, prompt: int, output: int, *, seconds: float = 120.0, start: float = 0.0
) -> list[SimRequest]:
    """Evenly spaced interactive requests of one shape."""
    count = int(rate * seconds)
    return [
        SimRequest(f"r{start:g}-{i}", start + i / rate, prompt, output, "acme", "interactive")
        for i in range(count)
    ]


def test_no_requests_need_no_replica_and_a_trickle_needs_one() -> None:
    assert lower_bound_replicas([], perf()) == 0
    assert lower_bound_replicas(stream(0.1, 200, 20), perf()) == 1


def test_the_bound_grows_with_the_load_it_must_carry() -> None:
    bounds = [lower_bound_replicas(stream(rate, 1000, 400), perf()) for rate in (20, 40, 80, 160)]
    assert all(bound is not None for bound in bounds)
    assert bounds == sorted(bounds)  # type: ignore[type-var]  # none is None
    low, high = bounds[0], bounds[-1]
    assert low is not None and high is not None and high >= 4 * low  # 8x the load


def test_only_the_counted_tiers_constrain_it() -> None:
    requests = stream(20, 1000, 400)
    batch = [replace(r, tier="batch") for r in requests]
    assert lower_bound_replicas(batch, perf()) == 0
    counted = lower_bound_replicas(batch, perf(), counted_tiers=("batch",))
    assert counted is not None and counted >= 1
    standard = [replace(r, tier="standard") for r in requests]
    both = lower_bound_replicas([*requests, *standard], perf())
    alone = lower_bound_replicas([*requests, *standard], perf(), counted_tiers=("interactive",))
    assert both is not None and alone is not None and both > alone


def test_a_prompt_no_replica_of_the_class_can_prefill_in_time_means_no_fleet() -> None:
    # 30k-token prompts cannot prefill within the interactive TTFT of 1 s on an L40S at all.
    long = stream(0.5, 30_000, 10)
    assert lower_bound_replicas(long, perf(L40S)) is None
    # One such request in a thousand is within the 1 % that may miss.
    short = stream(10, 500, 50, seconds=100)
    mixed = [*short[:-1], replace(long[0], arrival_s=short[-1].arrival_s)]
    assert lower_bound_replicas(mixed, perf(L40S)) is not None


def test_a_class_whose_lone_decode_step_exceeds_the_tpot_objective_has_no_fleet() -> None:
    # An L4 reads llama-3.1-8b's 16 GB of weights in about 76 ms: over the 50 ms objective.
    assert lower_bound_replicas(stream(1, 200, 20), perf("L4-24GB")) is None


def test_a_shared_prefix_is_counted_once() -> None:
    # Prefill-bound: long prompts, one output token each.
    shared = tuple(range(200))  # 200 blocks of 16 tokens: the whole 3,200-token prompt
    requests = stream(30, 3200, 1)
    alike = [replace(r, block_hashes=shared) for r in requests]
    distinct = [
        replace(r, block_hashes=tuple(range(i * 200, (i + 1) * 200)))
        for i, r in enumerate(requests)
    ]
    cached = lower_bound_replicas(alike, perf())
    uncached = lower_bound_replicas(distinct, perf())
    assert cached is not None and uncached is not None and cached < uncached


def test_a_burst_of_long_prompts_raises_the_bound_above_their_minute_average() -> None:
    # 600 prompts of 3,000 new tokens: 1.8 M tokens, 45 s of one H100's compute. Over a
    # minute that is one replica; arriving within 2 s, each prefilled within its 1 s TTFT,
    # they need a dozen.
    spread = stream(10, 3000, 2, seconds=60)
    burst = stream(300, 3000, 2, seconds=2, start=20)
    assert lower_bound_replicas(spread, perf()) == 1
    bound = lower_bound_replicas(burst, perf())
    assert bound is not None and bound >= 10


def test_long_decodes_hold_a_slot_each_so_the_bound_counts_them_over_max_num_seqs() -> None:
    # 60 requests/s, each decoding 1,000 tokens at 10 ms or more a step: at the end of the
    # 30 s, the last 9 s of arrivals (about 540) are all still decoding, and a replica holds
    # at most max_num_seqs of them.
    long = stream(60, 200, 1000, seconds=30)
    assert lower_bound_replicas(long, perf()) == 3
    assert lower_bound_replicas(long, perf(), max_num_seqs=128) == 5
    # The same arrivals with short outputs: a few dozen in flight at a time.
    assert lower_bound_replicas(stream(60, 200, 50, seconds=30), perf()) == 1


def test_decodes_of_every_context_share_their_tpot_budget() -> None:
    # 1,200 requests over 60 s on L40S (a = 29.5 ms, K = 217 ns a token): 268,350 decode
    # tokens, S1 = sum sqrt(K x) = 7,009, S2 = sum K x = 196 s, and 5,513 s of TPOT slack
    # (each token's 50 ms less a). At least S1^2 / 5,513 = 8,910 steps, so 262 s of fixed
    # parts and 196 s of KV reads: 458 s of steps within the 80 s to the last deadline, 6
    # replicas (term 6). One context per batch (term 5) sees 5.
    requests = spread_stream(20, 60)
    assert lower_bound_replicas(requests, perf(L40S)) == 6
    below = summarize(simulate(homogeneous(L40S, 5), requests, SimConfig("cost_aware")))
    assert below.tiers["interactive"].slo_attainment < 0.99


@pytest.mark.slow
@pytest.mark.parametrize("family", ["code", "chat", "rag", "diurnal"])
def test_no_router_meets_a_family_below_the_bound(family: str) -> None:
    """10 s of four of the six families on H100s (the others' 10 s fit one replica): the
    policies the routing benchmark finds best miss the SLO one replica below the bound, so
    the smallest fleet any of them finds is never below it."""
    requests = FAMILIES[family].generate(duration_s=10.0)
    bound = lower_bound_replicas(requests, perf(), counted_tiers=("interactive",))
    assert bound is not None and bound >= 2
    for policy in ("cost_aware", "least_load", "dynamo_kv"):
        below = summarize(simulate(homogeneous(H100, bound - 1), requests, SimConfig(policy)))
        assert below.tiers["interactive"].slo_attainment < 0.99, policy


@pytest.mark.slow
def test_no_router_in_the_simulator_meets_the_slo_below_the_bound() -> None:
    """Least load and cost-aware in the cluster simulator (the real router, the engine model)
    on one replica fewer than the bound: neither meets 99 % of interactive requests on both
    clocks, where the bound's own fleet size is not yet enough either (it is a floor)."""
    lengths = LengthMix(classes=(LengthClass(1.0, 800, 200),))
    requests = poisson(60.0, 60.0, lengths=lengths, seed=3)
    bound = lower_bound_replicas(requests, perf(L40S))
    assert bound is not None and bound >= 2
    for policy in ("least_load", "cost_aware"):
        below = summarize(simulate(homogeneous(L40S, bound - 1), requests, SimConfig(policy)))
        assert below.tiers["interactive"].slo_attainment < 0.99, policy


def heavy_batch_beside_a_trickle(replicas_of_prefill: float) -> list[SimRequest]:
    """A trickle of interactive chat beside batch prompts of 4,000 tokens whose prefill alone
    keeps `replicas_of_prefill` L40Ss computing, evenly spaced over 120 s."""
    rate = replicas_of_prefill / perf(L40S).compute_time_s(4000)
    batch = [replace(r, tier="batch") for r in stream(rate, 4000, 2, start=0.01)]
    return sorted([*stream(1, 200, 20), *batch], key=lambda r: r.arrival_s)


def test_the_other_tiers_kept_up_count_their_prefill() -> None:
    requests = heavy_batch_beside_a_trickle(4.0)
    alone = lower_bound_replicas(requests, perf(L40S), counted_tiers=("interactive",))
    kept_up = lower_bound_replicas(
        requests, perf(L40S), counted_tiers=("interactive",), kept_up_ttft_s=30.0
    )
    assert alone == 1
    # The whole span, to the last batch request's 30 s: every batch prompt but the 1 % that
    # may miss is computed in it, at least 4 x 120 / 150 replicas.
    batch = [r for r in requests if r.tier == "batch"]
    span = batch[-1].arrival_s + 30.0 - requests[0].arrival_s
    kept = len(batch) - 1 - int(0.99 * (len(batch) - 1))
    compute = perf(L40S).compute_time_s(4000) * (len(batch) - kept)
    assert kept_up is not None and kept_up >= math.ceil(compute / span) >= 4
    # Longer than the class's context, they never run and ask nothing.
    assert lower_bound_replicas(
        requests, perf(L40S), counted_tiers=("interactive",), kept_up_ttft_s=30.0,
        max_model_len=4000,
    ) == 1  # fmt: skip


@pytest.mark.slow
def test_below_the_bound_the_other_tiers_are_not_kept_up() -> None:
    """One replica below the bound that counts batch's prefill, least load and cost-aware
    leave batch's TTFT p99 past 30 s (what bench/routing.py calls not keeping up)."""
    requests = heavy_batch_beside_a_trickle(4.0)
    bound = lower_bound_replicas(
        requests, perf(L40S), counted_tiers=("interactive",), kept_up_ttft_s=30.0
    )
    assert bound is not None and bound >= 4
    for policy in ("least_load", "cost_aware"):
        below = summarize(simulate(homogeneous(L40S, bound - 1), requests, SimConfig(policy)))
        assert below.tiers["batch"].ttft_p99_s > 30.0, policy


def every_tier(requests: list[SimRequest]) -> list[SimRequest]:
    """The requests dealt to interactive, standard and batch in turn."""
    return [
        replace(r, tier=("interactive", "standard", "batch")[i % 3]) for i, r in enumerate(requests)
    ]


def test_the_sustained_floor_is_every_tiers_work_per_second_at_best_efficiency() -> None:
    # 20 requests/s for 60 s of 1,000-token prompts and 401 output tokens, a third of them
    # batch: decode-bound on an L40S. Per request 400 decode tokens reading 1,000 to 1,399
    # tokens of context: 479,800 token reads (K = 217 ns each) and 400 / 256 of a step's
    # fixed part a (29.5 ms). No tier counted: no TPOT objective limits the batch.
    requests = every_tier(stream(20, 1000, 401, seconds=60))
    model = perf(L40S)
    a = model.step_overhead_s + model.memory_time_s(0)
    k = model.memory_time_s(1) - model.memory_time_s(0)
    per_request_s = a * 400 / 256 + k * (400 * 1000 + 400 * 399 / 2)
    span = requests[-1].arrival_s - requests[0].arrival_s
    expected = len(requests) * per_request_s / span
    assert sustained_replicas(requests, model, counted_tiers=()) == pytest.approx(expected)
    assert 2.5 < expected < 3.5  # about 3 L40S; the bound, parking all but interactive, 2
    assert lower_bound_replicas(requests, model, counted_tiers=("interactive",)) == 2
    assert sustained_replicas([], model) == 0.0


def test_the_tpot_objective_limits_the_batch_the_sustained_floor_shares_a_step_over() -> None:
    # The same stream, interactive counted: at 1,000 to 1,399 tokens of context a step within
    # 50 ms carries (50 ms - a) / (K x context) = 72 to 101 interactive decodes, not 256.
    requests = every_tier(stream(20, 1000, 401, seconds=60))
    model = perf(L40S)
    a = model.step_overhead_s + model.memory_time_s(0)
    k = model.memory_time_s(1) - model.memory_time_s(0)
    span = requests[-1].arrival_s - requests[0].arrival_s
    reads = len(requests) * k * (400 * 1000 + 400 * 399 / 2)
    interactive_tokens = 400 * sum(r.tier == "interactive" for r in requests)

    def floor_at(context: int, kept: float) -> float:
        steps = kept * interactive_tokens * k * context / (0.05 - a)
        return (a * steps + reads) / span

    floor = sustained_replicas(requests, model, counted_tiers=("interactive",))
    assert floor > sustained_replicas(requests, model, counted_tiers=())
    # 1 % of interactive requests may miss: they drop out of the steps' count.
    assert floor_at(1000, 0.99) <= floor <= floor_at(1400, 1.0)


def test_a_request_no_replica_of_the_class_holds_asks_the_floor_no_work() -> None:
    # The simulator fails them ("too_long"): none of their tokens is ever computed.
    fits = stream(20, 1000, 401, seconds=60)
    longer = [replace(r, request_id=f"long-{r.request_id}", prompt_tokens=9000) for r in fits]
    model = perf(L40S)
    alone = sustained_replicas(fits, model, max_model_len=8192)
    assert sustained_replicas([*fits, *longer], model, max_model_len=8192) == alone
    assert sustained_replicas([*fits, *longer], model) > alone


def test_the_sustained_floor_computes_a_shared_prefix_once() -> None:
    # Prefill-bound: one output token each, so compute decides.
    requests = stream(30, 3200, 1)
    alike = [replace(r, block_hashes=tuple(range(200))) for r in requests]
    distinct = [
        replace(r, block_hashes=tuple(range(i * 200, (i + 1) * 200)))
        for i, r in enumerate(requests)
    ]
    assert sustained_replicas(alike, perf()) < sustained_replicas(distinct, perf()) / 100


@pytest.mark.parametrize("gpu", [H100, L40S])
def test_the_engine_model_is_busy_at_least_the_sustained_floor_times_the_span(gpu: str) -> None:
    """The work the floor counts is a lower bound on the steps' time: one replica serving a
    decode-heavy stream of every tier, at over twice what it can carry, is busy at least
    floor x span seconds (its batches full, within 40 % of it), so below the floor a fleet
    falls behind."""
    lengths = LengthMix(classes=(LengthClass(1.0, 300, 600),))
    requests = poisson(40.0, 60.0, lengths=lengths, seed=4)
    floor = sustained_replicas(requests, perf(gpu), counted_tiers=())
    span = requests[-1].arrival_s - requests[0].arrival_s
    result = simulate(homogeneous(gpu, 1), requests, SimConfig("least_load"))
    busy_s = sum(r.busy_s for r in result.replicas)
    assert floor > 2
    assert floor * span <= busy_s <= 1.4 * floor * span


def test_a_fleet_meeting_the_slo_is_busy_at_least_the_sustained_floor_times_the_span() -> None:
    """With interactive's TPOT objective in it: the smallest L40S fleet on which cost-aware
    keeps 99 % of interactive requests within both clocks, and its steps' time."""
    lengths = LengthMix(classes=(LengthClass(1.0, 300, 600),))
    requests = poisson(40.0, 60.0, lengths=lengths, seed=4)
    floor = sustained_replicas(requests, perf(L40S), counted_tiers=("interactive",))
    assert floor > sustained_replicas(requests, perf(L40S), counted_tiers=())
    span = requests[-1].arrival_s - requests[0].arrival_s
    result = simulate(homogeneous(L40S, 10), requests, SimConfig("cost_aware"))
    assert summarize(result).tiers["interactive"].slo_attainment >= 0.99
    assert sum(r.busy_s for r in result.replicas) >= floor * span
    assert 10 / 1.25 <= floor < 10  # the fleet found is within 1.25x of the floor
