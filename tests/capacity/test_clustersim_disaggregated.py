"""Disaggregated fleets in the cluster simulator: prefill and decode pools through the
disaggregated policy, each phase's GPU time counted, and colocated runs as they were."""

from __future__ import annotations

from dataclasses import replace

import pytest

from serving.clustersim import (
    LengthClass,
    LengthMix,
    SimConfig,
    homogeneous,
    poisson,
    simulate,
    summarize,
    with_budget,
)
from serving.clustersim.fleet import FleetSpec, PoolSpec, disaggregated

LONG = LengthMix((LengthClass(1.0, 6000, 100),))
SPLIT = SimConfig(policy="disaggregated")


def test_a_disaggregated_fleet_serves_every_request_through_both_phases() -> None:
    requests = poisson(3, 40, lengths=LONG, seed=1)
    result = simulate(disaggregated("H100-SXM-80GB", 1, "H100-SXM-80GB", 1), requests, SPLIT)
    assert len(result.records) == len(requests)
    for record in result.records:
        assert record.failed is None and record.finished_s is not None
        assert record.prefill_replica_id is not None and record.replica_id is not None
        assert record.prefill_replica_id.endswith("-0") and record.replica_id.endswith("-1")
        assert record.handoff_s is not None and record.kv_ready_s is not None
        assert record.first_token_s is not None
        # The client's first token comes from the decode replica, after the KV landed.
        assert record.request.arrival_s < record.handoff_s < record.kv_ready_s
        assert record.kv_ready_s < record.first_token_s
        assert record.output_tokens == record.request.output_tokens


def test_both_phases_gpu_time_is_counted() -> None:
    requests = poisson(3, 40, lengths=LONG, seed=1)
    summary = summarize(
        simulate(disaggregated("L40S-48GB", 2, "H200-SXM-141GB", 1), requests, SPLIT)
    )
    assert summary.disaggregated_share == 1.0
    assert summary.prefill_gpu_hours == pytest.approx(2 * summary.decode_gpu_hours, rel=0.01)
    assert summary.prefill_gpu_hours + summary.decode_gpu_hours == pytest.approx(summary.gpu_hours)
    assert summary.cost_per_hour == pytest.approx(2 * 0.99 + 3.99, rel=0.01)
    # 6000 tokens x 131072 bytes over 50 GB/s: about 16 ms.
    assert 0.012 < summary.transfer_p50_s < 0.025


def test_a_slower_link_delays_the_first_token_by_the_transfer() -> None:
    requests = poisson(1, 30, lengths=LONG, seed=2)
    fast = summarize(
        simulate(disaggregated("H100-SXM-80GB", 1, "H100-SXM-80GB", 1), requests, SPLIT)
    )
    slow_fleet = disaggregated("H100-SXM-80GB", 1, "H100-SXM-80GB", 1, kv_link="ethernet-25g")
    slow = summarize(simulate(slow_fleet, requests, SPLIT))
    assert slow.transfer_p50_s > 10 * fast.transfer_p50_s
    assert slow.ttft_p50_s - fast.ttft_p50_s == pytest.approx(
        slow.transfer_p50_s - fast.transfer_p50_s, rel=0.3
    )


def test_short_prompts_stay_colocated_where_a_fleet_has_both_kinds() -> None:
    fleet = FleetSpec(
        pools=(
            PoolSpec("h100", "H100-SXM-80GB", 2),
            PoolSpec("h100-prefill", "H100-SXM-80GB", 1, role="prefill"),
            PoolSpec("h100-decode", "H100-SXM-80GB", 1, role="decode"),
        )
    )
    short = LengthMix((LengthClass(1.0, 200, 100),))
    summary = summarize(simulate(fleet, poisson(2, 30, lengths=short, seed=3), SPLIT))
    assert summary.failed == 0
    assert summary.disaggregated_share < 0.05


def test_a_fleet_with_prefill_and_decode_pools_needs_the_disaggregated_policy() -> None:
    with pytest.raises(ValueError, match="disaggregated"):
        simulate(disaggregated("H100-SXM-80GB", 1, "H100-SXM-80GB", 1), [], SimConfig())


# Figures of these colocated runs from before the engine had roles (commit 5dac023): the
# disaggregated work must not move a colocated fleet's results by a single float. The mixed
# fleet's were taken again when the router's TPOT prediction learned the KV each decode step
# reads (serving/router/predict.py), and both cost-aware rows again when its prefix discount
# and its near-tie choice learned to weigh TPOT as well as TTFT, and once more when the
# prompt-rate time constant fell from 20 s to 5 s, and when the TPOT prediction learned
# that decodes ride in mixed steps (and the prompt rate's warm-up), and when cost-aware
# learned to keep the decode of the requests already on a replica within their TPOT
# objectives, and all three when the simulator stopped telling the router of a first token
# or a finish before it happened, and the L40S and A100 rows when their engines took
# vLLM's own prefill budget for their GPU (2048 tokens a step, not 8192): router,
# simulator and engine-flag changes, not the engine's roles, moved them; both cost-aware
# rows again when the router's steps learned to compute while they read the weights
# (`ReplicaPerf.compute_base_s`), and the mixed fleet's when a looser tier's request
# learned to gather where no tighter tier decodes, and again when it learned to gather
# on the least-bad path too; both cost-aware rows when its TTFT prediction stopped counting
# the prompt chunk of the step under way twice, and the H100 row when it stopped counting
# the prompts queued there among the decodes they wait behind and learned each replica's
# TTFT scale at its first tokens (`ReplicaState.ttft_scale`), and both cost-aware rows
# when the TTFT margin went to 0.9 while TPOT's stayed at 0.8 (`RouterConfig.ttft_margin`;
# the mixed fleet's TTFT p99 and both fleets' work cost fell). The engines keep
# vLLM's own budget (`max_num_batched_tokens="vllm"`) the figures were taken with; the
# platform's smaller one is a change of engine flags, tested on its own (test_step_budget).
COLOCATED_BEFORE = [
    (
        homogeneous("H100-SXM-80GB", 2),
        "cost_aware",
        (0.45696782147603443, 0.01755563430798013, 0.13184444444444446, 0.13368),
    ),
    (
        with_budget({"H100-SXM-80GB": 1, "L40S-48GB": 1}, 9.0),
        "cost_aware",
        (0.8815128509480189, 0.045724489954549315, 0.19693333333333338, 0.178265),
    ),
    (
        homogeneous("A100-SXM-80GB", 2),
        "least_load",
        (3.3428389575675204, 0.0950450635968975, 0.0735888888888889, 0.071324),
    ),
]


@pytest.mark.parametrize(("fleet", "policy", "figures"), COLOCATED_BEFORE)
def test_colocated_fleets_give_the_figures_they_gave_before(
    fleet: FleetSpec, policy: str, figures: tuple[float, float, float, float]
) -> None:
    fleet = replace(fleet, max_num_batched_tokens="vllm")
    summary = summarize(simulate(fleet, poisson(6, 60, seed=3), SimConfig(policy=policy)))
    assert (
        summary.ttft_p99_s,
        summary.tpot_p99_s,
        summary.cost_usd,
        summary.work_cost_usd,
    ) == figures
    assert summary.disaggregated_share == 0.0 and summary.prefill_gpu_hours == 0.0
