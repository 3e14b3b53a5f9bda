"""The cluster simulator: workloads, the event loop over the engine model and the real router,
figures, files, the autoscaler in the loop, and the router's saving against least load."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from metering.cost import (
    Placement,
    ReplicaWindow,
    mean_context,
    mean_decode_batch,
    moved_work_usd_micros,
    work_cost_usd_micros,
    work_weights,
)
from serving.capacity.autoscaler import AutoscalerConfig
from serving.clustersim import (
    AutoscaleBounds,
    FleetSpec,
    PoolSpec,
    SimConfig,
    SimRequest,
    Tenant,
    homogeneous,
    load_azure_conversation,
    load_mooncake,
    plot,
    poisson,
    simulate,
    summarize,
    write_csv,
)
from serving.clustersim.__main__ import main as cli_main
from serving.clustersim.__main__ import parse_fleet
from serving.clustersim.report import served_request, work_costs
from serving.clustersim.workloads import diurnal_rate, salted_blocks
from serving.engine.core import Engine, EngineRequest

ONE_TENANT = (Tenant("acme", "interactive"),)


def test_equal_prompt_blocks_hash_equal_only_within_a_tenant() -> None:
    acme = salted_blocks("acme", [1, 2], 1024)
    assert salted_blocks("acme", [1, 2], 1024) == acme
    assert not set(salted_blocks("globex", [1, 2], 1024)) & set(acme)


def test_a_mooncake_block_becomes_thirty_two_chained_engine_blocks() -> None:
    shared = salted_blocks("acme", [7, 8], 1024)
    forked = salted_blocks("acme", [7, 9], 1024)
    assert len(shared) == 64
    assert shared[:32] == forked[:32]
    assert shared[32] != forked[32]


def test_mooncake_requests_sharing_a_root_block_share_a_tenant(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    # Twenty roots of two requests each: enough distinct roots to keep each on one tenant.
    rows = []
    for root in range(20):
        rows.append(
            {
                "timestamp": root * 1000,
                "input_length": 1100,
                "output_length": 5,
                "hash_ids": [root, 100 + root, 200 + root],
            }
        )
        rows.append(
            {
                "timestamp": root * 1000 + 500,
                "input_length": 700,
                "output_length": 5,
                "hash_ids": [root, 300 + root],
            }
        )
    trace.write_text("\n".join(json.dumps(row) for row in rows))
    requests = load_mooncake(trace, rate_multiplier=2.0)
    for first, second in zip(requests[::2], requests[1::2], strict=True):
        assert first.tenant == second.tenant
        assert first.block_hashes[:32] == second.block_hashes[:32]
    assert len(requests[0].block_hashes) == 1100 // 16
    assert requests[1].arrival_s == pytest.approx(0.25)


def test_the_rate_multiplier_divides_azure_interarrival_times() -> None:
    slow = load_azure_conversation(window_s=60)
    fast = load_azure_conversation(rate_multiplier=3.0, window_s=20)
    assert len(fast) == pytest.approx(len(slow), abs=2)
    assert fast[10].arrival_s == pytest.approx(slow[10].arrival_s / 3)


def test_the_diurnal_rate_peaks_at_half_the_period() -> None:
    trough = diurnal_rate(10.0, 4.0, 100.0, 0.0)
    peak = diurnal_rate(10.0, 4.0, 100.0, 50.0)
    assert peak / trough == pytest.approx(4.0)
    assert (peak + trough) / 2 == pytest.approx(10.0)


def test_every_request_is_served_with_its_output_tokens() -> None:
    requests = poisson(5.0, 30.0, seed=3)
    result = simulate(homogeneous("H100-SXM-80GB", 2), requests)
    assert all(r.finished_s is not None for r in result.records)
    assert sum(r.output_tokens for r in result.records) == sum(q.output_tokens for q in requests)


def test_a_lone_request_sees_exactly_the_engine_models_ttft() -> None:
    request = SimRequest("one", 1.0, 3000, 20, "acme", "interactive")
    result = simulate(homogeneous("A100-SXM-80GB", 1), [request])
    fleet = homogeneous("A100-SXM-80GB", 1)
    pool = fleet.pools[0]
    engine = Engine(
        fleet.perf(pool), max_model_len=131072, max_num_batched_tokens=fleet.batched_tokens(pool)
    )
    engine.add_request(EngineRequest("one", 3000, 20, 1.0))
    first = next(e for e in engine.advance(math.inf) if e.kind == "first_token")
    assert result.records[0].ttft_s == pytest.approx(first.time_s - 1.0)


def test_an_l40s_prefills_a_long_prompt_in_the_steps_its_engine_was_launched_with() -> None:
    request = SimRequest("one", 1.0, 6000, 2, "acme", "interactive")
    fleet = homogeneous("L40S-48GB", 1)
    pool = fleet.pools[0]
    vllm = replace(fleet, max_num_batched_tokens="vllm")
    told = replace(fleet, max_num_batched_tokens=8192)
    batch = replace(fleet, slo_tier="batch")
    # The platform's choice for the interactive tier's 50 ms (serving.capacity.step_budget),
    # vLLM's own on an L40S, a deployment's own, and vLLM's again for a tier without TPOT.
    budgets = {512: fleet, 2048: vllm, 8192: told}
    for budget, spec in budgets.items():
        assert spec.batched_tokens(pool) == budget
    assert batch.batched_tokens(pool) == 2048
    ttfts: dict[int, float] = {}
    for budget, spec in budgets.items():
        engine = Engine(fleet.perf(pool), max_model_len=131072, max_num_batched_tokens=budget)
        engine.add_request(EngineRequest("one", 6000, 2, 1.0))
        first = next(e for e in engine.advance(math.inf) if e.kind == "first_token")
        ttft = simulate(spec, [request]).records[0].ttft_s
        assert ttft == pytest.approx(first.time_s - 1.0)
        ttfts[budget] = first.time_s - 1.0
    # Twelve steps of at most 512 tokens, three of 2048, or one of 6000: the times differ.
    assert len({round(ttft, 6) for ttft in ttfts.values()}) == 3


def test_a_static_fleet_costs_its_hourly_price_for_the_simulated_time() -> None:
    fleet = FleetSpec(pools=(PoolSpec("a100", "A100-SXM-80GB", 3, usd_per_gpu_hour=2.0),))
    result = simulate(fleet, poisson(2.0, 60.0, seed=1))
    summary = summarize(result)
    assert summary.cost_usd == pytest.approx(6.0 * result.ended_s / 3600)
    assert summary.gpu_hours == pytest.approx(3 * result.ended_s / 3600)


def test_compute_and_bandwidth_utilisation_follow_the_workloads_shape() -> None:
    fleet = homogeneous("H100-SXM-80GB", 1)
    prefill_heavy = [SimRequest(f"p{i}", i * 0.05, 4000, 2, "acme", "batch") for i in range(200)]
    decode_heavy = [SimRequest(f"d{i}", i * 0.05, 50, 400, "acme", "batch") for i in range(200)]
    # Planned for the batch tier, as this work is: the engine keeps vLLM's 8192-token steps.
    fleet = replace(fleet, slo_tier="batch")
    reading = summarize(simulate(fleet, prefill_heavy))
    writing = summarize(simulate(fleet, decode_heavy))
    for summary in (reading, writing):
        assert 0.0 < summary.compute_utilization <= summary.gpu_utilization <= 1.0
        assert 0.0 < summary.bandwidth_utilization <= summary.gpu_utilization
    # 4,000 prompt tokens every 50 ms is about 80k tokens/s of prefill: more than one
    # H100 computes, so the GPU is compute-bound; short prompts with long answers read
    # weights and KV every step instead.
    assert reading.compute_utilization > 0.9
    assert reading.compute_utilization > reading.bandwidth_utilization
    assert writing.bandwidth_utilization > writing.compute_utilization
    # Planned for the interactive tier, the same engine prefills in 1024-token steps, each
    # paying the step's fixed part and a weights read: it computes for less of the time.
    interactive = summarize(simulate(replace(fleet, slo_tier="interactive"), prefill_heavy))
    assert interactive.compute_utilization < reading.compute_utilization - 0.03


def test_cost_aware_routing_sends_batch_work_to_the_cheapest_gpus() -> None:
    fleet = FleetSpec(
        pools=(PoolSpec("h100", "H100-SXM-80GB", 2), PoolSpec("l40s", "L40S-48GB", 2))
    )
    requests = poisson(2.0, 30.0, tenants=(Tenant("umbrella", "batch"),), seed=2)
    summary = summarize(simulate(fleet, requests, SimConfig(policy="cost_aware")))
    assert summary.share_by_gpu == {"L40S-48GB": 1.0}


def test_round_robin_spreads_requests_over_every_replica() -> None:
    requests = poisson(4.0, 30.0, tenants=ONE_TENANT, seed=4)
    result = simulate(homogeneous("H100-SXM-80GB", 4), requests, SimConfig(policy="round_robin"))
    used = {r.replica_id for r in result.records}
    assert len(used) == 4


def test_the_autoscaler_adds_replicas_when_load_outgrows_the_fleet() -> None:
    fleet = FleetSpec(
        pools=(PoolSpec("h100", "H100-SXM-80GB", 1, autoscale=AutoscaleBounds(1, 6)),)
    )
    config = SimConfig(
        policy="least_load",
        autoscaler=AutoscalerConfig(target_running_per_replica=16.0),
        cold_start_s=30.0,
    )
    result = simulate(fleet, poisson(12.0, 240.0, tenants=ONE_TENANT, seed=5), config)
    assert max(point.ready["h100"] for point in result.timeline) > 1
    assert result.scaling_events[0][3].startswith("up")


@pytest.mark.parametrize(
    ("rate_per_s", "looser", "looser_p95_over_s"),
    [(3.0, "standard", 1.0), (4.0, "batch", 5.0)],
)
def test_the_autoscaler_reads_each_requests_ttft_against_its_own_tiers_objective(
    rate_per_s: float, looser: str, looser_p95_over_s: float
) -> None:
    """The same prompts on one L40S: late for interactive (1 s), on time for a looser tier
    (standard's 3 s; batch has none), so only interactive's scale the pool on TTFT."""
    fleet = FleetSpec(pools=(PoolSpec("l40s", "L40S-48GB", 1, autoscale=AutoscaleBounds(1, 6)),))
    config = SimConfig(
        policy="least_load",
        # Load and KV use stay out of it: TTFT is the only signal that can move the pool.
        autoscaler=AutoscalerConfig(target_running_per_replica=256.0, kv_target=None),
        cold_start_s=30.0,
    )

    def run(tier: str) -> tuple[float, list[str]]:
        requests = poisson(rate_per_s, 180.0, tenants=(Tenant("acme", tier),), seed=5)
        result = simulate(fleet, requests, config)
        return summarize(result).ttft_p95_s, [event[3] for event in result.scaling_events]

    interactive_p95, interactive_scaling = run("interactive")
    looser_p95, looser_scaling = run(looser)
    assert interactive_p95 > 1.0 and "up on ttft" in interactive_scaling
    assert looser_p95 > looser_p95_over_s  # queued past interactive's objective, and
    assert "up on ttft" not in looser_scaling  # within its own (or with none)


def test_replicas_added_by_the_autoscaler_are_paid_for_from_their_cold_start() -> None:
    fleet = FleetSpec(
        pools=(PoolSpec("h100", "H100-SXM-80GB", 1, autoscale=AutoscaleBounds(1, 6)),)
    )
    config = SimConfig(autoscaler=AutoscalerConfig(target_running_per_replica=16.0))
    result = simulate(fleet, poisson(12.0, 240.0, tenants=ONE_TENANT, seed=5), config)
    late = [r for r in result.replicas if r.started_s > 0]
    assert late
    assert all(r.ready_s - r.started_s == pytest.approx(config.cold_start_s) for r in late)
    summary = summarize(result)
    expected = sum((r.stopped_s or result.ended_s) - r.started_s for r in result.replicas) / 3600
    assert summary.gpu_hours == pytest.approx(expected)


def test_the_report_writes_csv_and_png(tmp_path: Path) -> None:
    result = simulate(homogeneous("L40S-48GB", 2), poisson(2.0, 20.0, seed=6))
    summary = summarize(result)
    paths = write_csv(result, summary, tmp_path) + plot(result, summary, tmp_path)
    assert {p.name for p in paths} == {
        "requests.csv",
        "summary.csv",
        "timeline.csv",
        "ttft_cdf.png",
        "timeline.png",
    }
    assert (tmp_path / "ttft_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert len((tmp_path / "requests.csv").read_text().splitlines()) == len(result.records) + 1


def test_slo_attainment_counts_requests_over_the_objective_as_misses() -> None:
    requests = [SimRequest(f"r{i}", 0.0, 6000, 10, "acme", "interactive") for i in range(40)]
    summary = summarize(simulate(homogeneous("L4-24GB", 1), requests))
    tier = summary.tiers["interactive"]
    met = sum(
        1
        for r in simulate(homogeneous("L4-24GB", 1), requests).records
        if r.ttft_s is not None and r.ttft_s <= 1.0
    )
    assert tier.ttft_attainment == pytest.approx(met / 40)
    assert tier.ttft_attainment < 1.0


def test_the_cli_prints_a_summary(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cli_main(
        [
            "--workload",
            "poisson",
            "--rate",
            "2",
            "--duration",
            "20",
            "--fleet",
            "H100-SXM-80GB:1,L40S-48GB:1",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert "cost_aware on 1x H100-SXM-80GB + 1x L40S-48GB" in out
    assert "saving vs least load $" in out
    header = (tmp_path / "summary.csv").read_text().splitlines()[0].split(",")
    assert {"work_cost_usd", "baseline_work_cost_usd", "saving_vs_least_load_usd"} <= set(header)


def test_a_static_comparison_sizes_for_the_autoscaled_peak(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cli_main(
        [
            "--workload",
            "poisson",
            "--rate",
            "12",
            "--duration",
            "200",
            "--fleet",
            "H100-SXM-80GB:1",
            "--autoscale",
            "1:4",
            "--cold-start",
            "20",
            "--compare-static",
        ]
    )
    assert "static provisioning for the peak" in capsys.readouterr().out


def test_autoscale_bounds_are_given_for_all_pools_or_one_for_each() -> None:
    one = parse_fleet("H100-SXM-80GB:2,L40S-48GB:7", "1:8", "llama-3.1-8b")
    each = parse_fleet("H100-SXM-80GB:2,L40S-48GB:7", "1:4,2:14", "llama-3.1-8b")

    assert [p.autoscale for p in one.pools] == [AutoscaleBounds(1, 8)] * 2
    assert [p.autoscale for p in each.pools] == [AutoscaleBounds(1, 4), AutoscaleBounds(2, 14)]
    with pytest.raises(ValueError, match="one for every pool or one for all"):
        parse_fleet("H100-SXM-80GB:2,L40S-48GB:7", "1:4,2:14,1:2", "llama-3.1-8b")


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        replace(SimConfig(), policy="random")


def test_the_routers_in_flight_prompt_accounting_returns_to_zero_after_a_run() -> None:
    fleet = FleetSpec(
        pools=(PoolSpec("h100", "H100-SXM-80GB", 1), PoolSpec("l40s", "L40S-48GB", 2))
    )
    result = simulate(fleet, poisson(4.0, 30.0, seed=5), SimConfig(policy="cost_aware"))
    assert all(r.finished_s is not None for r in result.records)
    for replica in result.replicas:
        state = replica.state
        assert (state.inflight, state.inflight_prompt_tokens, state.prefill_pending_tokens) == (
            0,
            0,
            0,
        )


# A dear and a cheap GPU class; long prompts and short answers, so the work is mostly
# prefill, which the L40S computes for less per token than the H100 at list prices.
TWO_CLASSES = FleetSpec(
    pools=(PoolSpec("h100", "H100-SXM-80GB", 1), PoolSpec("l40s", "L40S-48GB", 1))
)
PREFILL_HEAVY = [SimRequest(f"r{i}", i * 0.25, 3000, 20, "umbrella", "batch") for i in range(60)]


def test_cost_aware_saves_the_price_of_the_work_it_moved_off_the_dear_gpus() -> None:
    result = simulate(TWO_CLASSES, PREFILL_HEAVY, SimConfig(policy="cost_aware"))
    summary = summarize(result)
    costs = work_costs(result)

    assert summary.share_by_gpu == {"L40S-48GB": 1.0}
    # The H100 stays idle (or ties and comes first), so least load would have sent it each one.
    assert {cost.baseline_replica_id for cost in costs} == {"h100-0"}
    assert summary.saving_vs_least_load_usd > 0
    assert summary.saving_vs_least_load_usd == pytest.approx(
        sum(cost.baseline_usd_micros - cost.usd_micros for cost in costs) / 1e6
    )
    assert summary.work_cost_usd == pytest.approx(sum(c.usd_micros for c in costs) / 1e6)


def test_each_requests_work_is_priced_by_meterings_rule_on_both_replicas() -> None:
    result = simulate(TWO_CLASSES, PREFILL_HEAVY, SimConfig(policy="cost_aware"))
    l40s = next(r for r in result.replicas if r.pool.name == "l40s")
    h100 = next(r for r in result.replicas if r.pool.name == "h100")
    served = [served_request(r) for r in result.records]
    window = ReplicaWindow(
        replica_id=l40s.replica_id,
        ready_us=round((result.ended_s - l40s.ready_s) * 1e6),
        gpus=1,
        usd_micros_per_gpu_hour=990_000,
    )
    batch, context = mean_decode_batch(window, served), mean_context(served)
    here = Placement(TWO_CLASSES.perf(l40s.pool), 1, 990_000)
    there = Placement(TWO_CLASSES.perf(h100.pool), 1, 3_490_000)

    cost = next(c for c in work_costs(result) if c.baseline_replica_id == h100.replica_id)
    request = next(s for s in served if s.request_id == cost.request_id)

    assert cost.usd_micros == work_cost_usd_micros(
        work_weights(here.perf, batch, context), 1, 990_000, request
    )
    assert cost.baseline_usd_micros - cost.usd_micros == moved_work_usd_micros(
        request, here, there, batch, context
    )
    assert cost.baseline_usd_micros > cost.usd_micros


def test_the_baseline_replica_is_priced_at_the_batch_of_the_one_the_request_ran_on() -> None:
    # Two H100s: least load spreads the work, so each request's baseline is often the other
    # replica, whose own batch differs. Same hardware at one batch: nothing moves.
    fleet = FleetSpec(pools=(PoolSpec("h100", "H100-SXM-80GB", 2),))
    requests = [SimRequest(f"r{i}", i * 0.1, 800, 200, "umbrella", "batch") for i in range(80)]
    result = simulate(fleet, requests, SimConfig(policy="cost_aware"))
    costs = work_costs(result)

    assert any(c.baseline_replica_id != c.replica_id for c in costs)
    assert all(c.baseline_usd_micros == c.usd_micros for c in costs)


def test_under_least_load_the_saving_against_least_load_is_exactly_zero() -> None:
    result = simulate(TWO_CLASSES, PREFILL_HEAVY, SimConfig(policy="least_load"))
    summary = summarize(result)

    assert len(summary.share_by_gpu) == 2
    assert summary.saving_vs_least_load_usd == 0
    assert summary.baseline_work_cost_usd == summary.work_cost_usd > 0


@pytest.mark.parametrize("budget", [None, "auto", 0, True])
def test_a_fleet_refuses_a_prefill_budget_that_is_not_a_name_or_a_count(budget: object) -> None:
    with pytest.raises(ValueError, match="'platform', 'vllm' or a positive count"):
        replace(homogeneous("L40S-48GB", 1), max_num_batched_tokens=budget)  # type: ignore[arg-type]


def test_a_fleet_refuses_a_prefill_budget_below_max_num_seqs_as_vllm_does() -> None:
    with pytest.raises(ValueError, match=r"\(128\) is below max_num_seqs \(256\)"):
        replace(homogeneous("L40S-48GB", 1), max_num_batched_tokens=128)
